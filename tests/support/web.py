"""The project's web app behind a real gunicorn, on the tests' database and a free port."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import ROOT, free_port, service_env, wait_until


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: Any


@dataclass
class WebServer:
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connection(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.connect()
        return conn

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        conn: http.client.HTTPConnection | None = None,
    ) -> Answer:
        """One request; a JSON body is sent as JSON, the answer's JSON decoded."""
        own = conn is None
        conn = conn or self.connection()
        try:
            data = None if body is None else json.dumps(body).encode()
            sent = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=sent)
            response = conn.getresponse()
            raw = response.read()
            kind = response.getheader("Content-Type", "")
            json_kinds = ("application/json", "application/problem+json")
            decoded = json.loads(raw) if raw and kind.startswith(json_kinds) else raw
            return Answer(response.status, dict(response.getheaders()), decoded)
        finally:
            if own:
                conn.close()


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


@contextmanager
def gunicorn(
    log_dir: Path, *, workers: int = 2, threads: int = 4, worker_class: str = "gthread", **env: str
) -> Iterator[WebServer]:
    """gunicorn serving ``config.wsgi`` with the test settings until the block ends: the same
    server the container image runs, with ``workers`` × ``threads`` requests at once (``sync``
    workers: one each, and a busy one accepts no connection, so concurrent requests spread
    over all of them)."""
    port = free_port()
    log = log_dir / f"gunicorn-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "config.wsgi:application",
                f"--bind=127.0.0.1:{port}",
                f"--workers={workers}",
                f"--threads={threads}",
                f"--worker-class={worker_class}",
                "--timeout=60",
            ],
            cwd=ROOT,
            env=service_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = WebServer(port, process, log)
    try:
        wait_until(
            lambda: _up(port) or process.poll() is not None, timeout=60, what="gunicorn's /healthz"
        )
        if process.poll() is not None:
            raise RuntimeError(f"gunicorn exited {process.returncode}:\n{log.read_text()[-3000:]}")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def web_options() -> dict[str, Any]:
    """How the ``web`` fixture runs gunicorn (``gunicorn``'s keyword arguments): a module whose
    tests need other workers, threads or variables overrides this fixture."""
    return {}


@pytest.fixture
def web(transactional_db: None, tmp_path: Path, web_options: dict[str, Any]) -> Iterator[WebServer]:
    """The web behind gunicorn for the test, on the test database (committed data)."""
    with gunicorn(tmp_path, **web_options) as server:
        yield server
