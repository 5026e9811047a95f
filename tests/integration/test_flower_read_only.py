"""Flower as every shipped configuration starts it (compose, scripts/run.py, Kubernetes: the same
`--read_only=True`): a real Flower process on the tests' broker refuses control operations with
403 to an authenticated user, and refuses anyone without the basic-auth credentials.

The same Flower without the flag takes the request to the control handler (404: no worker of
that name), so the 403 comes from read-only mode and not from something else refusing."""

from __future__ import annotations

import base64
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import yaml

from tests.support.fleet import ROOT, free_port, service_env, wait_until

USER, PASSWORD = "ops", "a-long-flower-password"


def _compose_flower_args() -> list[str]:
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["flower"][
        "command"
    ]
    args = command[command.index("flower") + 1 :]
    # the compose port, database path and persistence are the container's; the flags stay
    return [a for a in args if not a.startswith(("--port", "--db", "--persistent"))]


def _post(port: int, path: str, auth: bool) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    if auth:
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _flower(args: list[str]) -> Iterator[int]:
    port = free_port()
    env = {**service_env(), "FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "flower", "--address=127.0.0.1",
         f"--port={port}", *args],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_until(lambda: _up(port) or process.poll() is not None, timeout=60, what="Flower")
        assert process.poll() is None, process.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        yield port
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture
def read_only_flower() -> Iterator[int]:
    yield from _flower(_compose_flower_args())


@pytest.fixture
def full_control_flower() -> Iterator[int]:
    yield from _flower([a for a in _compose_flower_args() if not a.startswith("--read_only")])


CONTROL = "/api/worker/shutdown/worker1@nowhere"


def test_the_shipped_flower_refuses_control_operations(read_only_flower: int) -> None:
    assert "--read_only=True" in _compose_flower_args()
    # an authenticated operator presses "shut down": read-only mode refuses it
    assert _post(read_only_flower, CONTROL, auth=True) == 403
    assert _post(read_only_flower, "/api/task/revoke/some-task-id", auth=True) == 403
    # without the credentials nothing gets that far
    assert _post(read_only_flower, CONTROL, auth=False) == 401


def test_without_the_flag_the_same_request_reaches_the_control_handler(
    full_control_flower: int,
) -> None:
    assert _post(full_control_flower, CONTROL, auth=True) == 404  # no such worker
