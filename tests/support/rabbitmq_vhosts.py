"""Vhosts of a test module's own on the machine's RabbitMQ: made with ``rabbitmqctl``, guest
allowed in, deleted afterwards; a missing server or tool is a missing tool (skipped in a
person's run, a failure in CI)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

from tests.support.missing_tools import skip_for_missing

AMQP_HOST, AMQP_PORT = "127.0.0.1", 5672


def vhost_url(vhost: str) -> str:
    return f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/{quote(vhost, safe='')}"


def rabbitmqctl(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Run ``rabbitmqctl`` once per command, all at once (each call is mostly the start of an
    Erlang VM, a second or so): the results in order."""
    ctl = shutil.which("rabbitmqctl")
    assert ctl is not None
    running = [
        subprocess.Popen(
            [ctl, "-q", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command in commands
    ]
    done = []
    for command, process in zip(commands, running, strict=True):
        out, err = process.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(command, process.returncode, out, err))
    return done


def failures(results: list[subprocess.CompletedProcess[str]]) -> str:
    return "; ".join(
        f"rabbitmqctl {' '.join(r.args)}: {r.stderr.strip()[:200]}" for r in results if r.returncode
    )


@contextmanager
def private_vhosts(*names: str) -> Iterator[None]:
    """The vhosts ``names`` (one left by an earlier run of the same pid is this run's too),
    guest allowed everything in them, deleted on the way out."""
    if not shutil.which("rabbitmqctl"):
        skip_for_missing("rabbitmq-server", "rabbitmqctl is needed to make a test's vhost")
    try:
        socket.create_connection((AMQP_HOST, AMQP_PORT), timeout=2).close()
    except OSError as exc:
        skip_for_missing("rabbitmq-server", f"no RabbitMQ at {AMQP_HOST}:{AMQP_PORT}: {exc}")
    added = rabbitmqctl(*(["add_vhost", name] for name in names))
    made = [
        n for n, r in zip(names, added, strict=True) if not r.returncode or "already" in r.stderr
    ]
    try:
        if made != list(names):
            skip_for_missing("rabbitmq-server", f"cannot make a vhost: {failures(added)}")
        allowed = rabbitmqctl(
            *(["set_permissions", "-p", name, "guest", ".*", ".*", ".*"] for name in names)
        )
        assert not failures(allowed), failures(allowed)
        yield
    finally:
        if made:
            deleted = rabbitmqctl(*(["delete_vhost", name] for name in made))
            assert not failures(deleted), failures(deleted)
