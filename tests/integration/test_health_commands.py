"""The compose/Kubernetes health checks, run as the probes run them (``manage.py`` in a
subprocess): ``beat_health`` against a real beat, ``worker_health`` against real workers."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cleanup.release.schedule import install_schedule
from tests.support.fleet import ROOT, Worker, beats, service_env, wait_until

pytestmark = [pytest.mark.workers]


def manage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env or service_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def beat_health() -> subprocess.CompletedProcess[str]:
    return manage("beat_health")


def test_beat_health_is_ok_only_while_a_beat_holds_the_leader_lock(
    transactional_db: None, tmp_path: Path
) -> None:
    # given: no beat running
    install_schedule(shards=1, every=5)
    before = beat_health()
    assert before.returncode == 1 and "no beat holds the leader lock" in before.stderr

    # when: a beat starts and takes the lock
    with beats(tmp_path, 1) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat leader")
        during = beat_health()
    # then: healthy while it runs, unhealthy again once it is gone
    assert during.returncode == 0, during.stderr
    wait_until(lambda: beat_health().returncode == 1, timeout=30, what="lock released")


def test_worker_health_is_ok_only_for_a_worker_that_answers_its_ping(workers: list[Worker]) -> None:
    # given: a running worker, named as celery names it (-n name@%h)
    name = f"{workers[0].name}@{socket.gethostname()}"
    # then: it answers
    ok = manage("worker_health", "--name", name, "--timeout", "5")
    assert ok.returncode == 0, ok.stderr
    assert f"ok: {name} answered" in ok.stdout
    # a worker that is not there does not
    gone = manage("worker_health", "--name", "absent@nowhere", "--timeout", "1")
    assert gone.returncode == 1
    assert "unhealthy: absent@nowhere did not answer within 1.0 s" in gone.stderr
    # and nothing answers through a broker that cannot be reached
    down_env = service_env(CELERY_BROKER_URL="redis://127.0.0.1:1/0")  # nothing listens on 1
    down = manage("worker_health", "--name", name, "--timeout", "1", env=down_env)
    assert down.returncode == 1
    assert "unhealthy: cannot reach the broker" in down.stderr
