"""``manage.py requeue_dead_letters``: progress, a summary and how many more match past
``--limit``; a failed publish stops it with exit status 1, every letter not sent staying
open."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cleanup.broker.readers import queue_depth
from cleanup.models import DeadLetter
from tests.support import ROOT
from tests.support.dead_letters import MALFORMED, history, is_open, letter, requeueable, run_command
from tests.support.fleet import service_env


def test_requeue_shows_progress_a_summary_and_how_many_more_match(db, broker, settings):
    good = [requeueable(100 + i) for i in range(3)]
    bad = [letter(MALFORMED), letter(MALFORMED)]
    # dry run first: what each would become, nothing sent
    out, _ = run_command("requeue_dead_letters", "--dry-run", "--limit", "4")
    assert "would requeue 4 open dead letter(s) (retries_exhausted 3, malformed 1)" in out
    assert "would requeue: republished: 3" in out
    assert "stopped at --limit 4: 1 more open dead letter(s) match" in out
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    # then for real
    out, err = run_command("requeue_dead_letters", "--limit", "4", "--by", "erin")
    progress = [line for line in err.splitlines() if line.startswith("progress: ")]
    assert progress[-1].startswith("progress: 4/4 (")
    assert len(progress) == 4  # one line per letter up to 10, then about 10 in all
    assert (
        "summary: requeued 3 (republished 3, rescheduled 0), failed 0, not tried 0, skipped 1"
        in out
    )
    assert "stopped at --limit 4: 1 more open dead letter(s) match" in out
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 3
    assert is_open(*good, *bad) == [False, False, False, True, True]
    resolved = DeadLetter.objects.get(pk=good[0].pk)
    assert (resolved.resolution, resolved.resolved_by) == ("republished", "erin")
    assert history(good[0].pk) == [
        ("manage.py", "requeue_dead_letters (manage.py, by erin): republished")
    ]
    assert history(bad[0].pk) == []  # not requeueable: still open, nothing to record


@pytest.mark.django_db(transaction=True)
def test_a_failed_publish_stops_the_requeue_exits_1_and_every_letter_stays_open():
    # given: three letters to republish, and a broker that refuses connections
    letters = [requeueable(200), requeueable(201), requeueable(202)]
    done = subprocess.run(
        [sys.executable, "manage.py", "requeue_dead_letters"],
        cwd=ROOT,
        env=service_env(CELERY_BROKER_URL="redis://127.0.0.1:1/0"),  # nothing listens on 1
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # then: the first send fails after the publish's retries and the requeue stops there,
    # instead of paying those retries again for each letter
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "summary: requeued 0 (republished 0, rescheduled 0), failed 1, not tried 2, skipped 0"
        in done.stdout
    )
    assert "a requeue ended in error, so the 2 letter(s) after it were not tried" in done.stderr
    assert "Error: OperationalError: Error 111 connecting to 127.0.0.1:1" in done.stderr
    assert is_open(*letters) == [True, True, True]
    assert [history(one.pk) for one in letters] == [[], [], []]
