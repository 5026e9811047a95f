"""``manage.py beat_health`` (the compose/Kubernetes health check of beat) against a real beat."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cleanup.schedule import install_schedule

from .fleet import ROOT, beats, service_env, wait_until

pytestmark = [pytest.mark.workers]


def beat_health() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "beat_health"],
        cwd=ROOT,
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


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
