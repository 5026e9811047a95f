"""The apps' Celery app (cleanup.broker.celery_app): what a deployment chooses in its CELERY_
settings is what the workers run with, except the delivery policy, which no setting turns off.

Break: give the defaults to Celery's ``add_defaults`` (they would rank above the settings, and a
benchmark's prefetch or the tests' 1 s beat loop would be ignored); drop the policy's update."""

from __future__ import annotations

import json

from tests.support.child_python import run_with, settings_env

READ = (
    "import json, django; django.setup(); from cleanup.celery import app; c = app.conf; "
    "print(json.dumps([c.worker_prefetch_multiplier, c.beat_max_loop_interval, "
    "c.worker_send_task_events, c.task_acks_late, c.accept_content]))"
)


def test_chosen_settings_hold_and_the_policy_cannot_be_turned_off() -> None:
    chosen = settings_env(
        {
            "CELERY_WORKER_PREFETCH_MULTIPLIER": 4,
            "CELERY_WORKER_SEND_TASK_EVENTS": False,
            "CELERY_TASK_ACKS_LATE": False,
            "CELERY_ACCEPT_CONTENT": ["json", "pickle"],
        }
    )
    done = run_with(READ, **chosen)
    assert done.returncode == 0, done.stderr
    prefetch, beat_loop, events, acks_late, accept = json.loads(done.stdout.splitlines()[-1])
    # the deployment's choices, and the test settings' 1 s beat loop, hold
    assert (prefetch, beat_loop, events) == (4, 1, False)
    # the policy does not bend
    assert (acks_late, accept) == (True, ["json"])
