"""Task failure handling with a real worker: a release that keeps failing transiently until its
retries run out, one stuck past its soft time limit, and one that fails with a non-transient
error each end as one dead letter with the right reason, the hold still held and the message
kept for a requeue; a worker whose delivery counter is unreachable still releases; and a
release that races real concurrent writers raises ``TransientConflict`` and is retried.

Failures are injected in PostgreSQL (a trigger on the release's UPDATE, row and table locks
held by the test's own connections), never by patching the product.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.operations import triage
from cleanup.release.messages import build
from cleanup.wire import RELEASE_TASK
from config.celery_app import app
from tests.support import fleet
from tests.support.wire import send_signed

pytestmark = [pytest.mark.workers]

# Few, short retries, so the failure paths end within seconds. (The time limits a release
# runs under travel in the message's headers from the publisher: the test process's 8 s.)
FAILING_ENV = {"CLEANUP_MAX_RETRIES": "2", "CLEANUP_RETRY_BACKOFF_MAX": "1"}

FAILING_TRIGGER = """
CREATE OR REPLACE FUNCTION failure_test_fail_release() RETURNS trigger AS $$
BEGIN
  RAISE EXCEPTION 'injected failure' USING ERRCODE = '{errcode}';
END $$ LANGUAGE plpgsql;
CREATE TRIGGER failure_test_fail_release BEFORE UPDATE ON reservations_reservation
  FOR EACH ROW WHEN (NEW.status = 'released') EXECUTE FUNCTION failure_test_fail_release();
"""


@contextmanager
def every_release_fails(errcode: str) -> Iterator[None]:
    with connection.cursor() as cur:
        cur.execute(FAILING_TRIGGER.format(errcode=errcode))
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute(
                "DROP TRIGGER IF EXISTS failure_test_fail_release ON reservations_reservation; "
                "DROP FUNCTION IF EXISTS failure_test_fail_release()"
            )


def _the_dead_letter(hold_id: int) -> DeadLetter:
    fleet.wait_until(
        lambda: DeadLetter.objects.filter(reservation_id=hold_id).exists(),
        timeout=90,
        what="a dead letter",
    )
    return DeadLetter.objects.get(reservation_id=hold_id)


@pytest.mark.parametrize(
    ("errcode", "reason", "attempts"),
    [
        # serialization failure: transient, retried twice, then retries_exhausted
        ("40001", DeadLetter.Reason.RETRIES_EXHAUSTED, 3),
        # raise_exception: not transient, not retried: failed
        ("P0001", DeadLetter.Reason.FAILED, 1),
    ],
)
def test_a_release_that_keeps_failing_is_dead_lettered_with_its_reason(
    clean, exclusive_workers, tmp_path: Path, errcode: str, reason: str, attempts: int
) -> None:
    hold_id, _ = fleet.one_eligible_hold()
    with every_release_fails(errcode), fleet.dedicated(tmp_path, {"env": FAILING_ENV}) as (worker,):
        message = fleet.publish_for(hold_id)
        letter = _the_dead_letter(hold_id)
        # the attempts the worker logged for this task before giving up
        fleet.wait_until(
            lambda: (
                len(fleet.log_lines([worker.log_path], "transient failure, retrying"))
                == attempts - 1
            ),
            timeout=30,
            what="retry log lines",
        )
    # then: one letter, the right reason, the message kept as published, the hold untouched
    assert DeadLetter.objects.count() == 1
    assert letter.reason == reason
    assert "injected failure" in letter.error
    assert letter.message == message
    assert letter.idempotency_key == message["idempotency_key"]
    assert letter.task_name == "cleanup.release_reservation"
    assert fleet.status_of(hold_id) == "held"
    assert fleet.outcome_counts() == {}
    assert fleet.invariant_violations() == []


def test_a_release_stuck_past_its_soft_time_limit_is_dead_lettered_as_time_limit(
    clean, exclusive_workers, tmp_path: Path
) -> None:
    # given: the release waits on the offering's row lock, held by the test, past the limit
    hold_id, offering_id = fleet.one_eligible_hold()
    with fleet.dedicated(tmp_path, {"env": FAILING_ENV}) as (worker,):
        with fleet.offering_locked(offering_id):
            message = fleet.publish_for(hold_id)
            fleet.wait_until(
                fleet.blocked_backends, timeout=30, what="release waiting on the row lock"
            )
            letter = _the_dead_letter(hold_id)
            # then: time_limit, with the message kept for a requeue
            assert letter.reason == DeadLetter.Reason.TIME_LIMIT
            assert letter.message == message
        # The interrupted task's statement may still be waiting in PostgreSQL and commit once
        # the lock goes (the same as a killed worker's orphan statement): either way, a requeue
        # of the letter ends with the hold released exactly once.
        fleet.wait_until(
            lambda: not fleet.blocked_backends(), timeout=30, what="the lock wait ended"
        )
        orphan_committed = fleet.status_of(hold_id) == "released"
        assert triage.requeue([letter]) == {"republished": 1}
        # the requeued message is a new first delivery: its attempt is logged (the interrupted
        # one logged none)
        fleet.wait_until(
            lambda: fleet.log_lines(
                [worker.log_path], f"release attempt reservation_id={hold_id} "
            ),
            timeout=60,
            what="requeued delivery",
        )
        fleet.wait_until(
            lambda: fleet.status_of(hold_id) == "released", timeout=60, what="released"
        )
        # and the worker goes on working
        other = fleet.create_eligible_holds(1, offerings=1)[0]
        fleet.publish_for(other)
        fleet.wait_until(
            lambda: fleet.status_of(other) == "released", timeout=60, what="next release"
        )
    print(f"\ntime limit: the interrupted statement committed on its own: {orphan_committed}")
    assert DeadLetter.objects.count() == 1
    assert fleet.outcome_counts() == {"released": 2}
    assert fleet.invariant_violations(expected_released=[hold_id, other]) == []


def test_a_worker_whose_tally_redis_is_unreachable_still_counts_and_releases(
    clean, exclusive_workers, tmp_path: Path
) -> None:
    # given: the tally's Redis URL points at a port where nothing listens, and five release
    # messages that arrive as retries (a first delivery is never counted; a retry always is)
    ids = fleet.create_eligible_holds(5, offerings=1)
    env = {"CLEANUP_COUNTER_REDIS_URL": "redis://127.0.0.1:9/0"}
    with fleet.dedicated(tmp_path, {"env": env}) as (worker,):
        for hold_id in ids:
            expires_at = fleet.scalar(
                "SELECT expires_at FROM reservations_reservation WHERE id = %s", [hold_id]
            )
            message = build(hold_id, 1, expires_at, 0, "counter-down")
            send_signed(
                app, RELEASE_TASK, (message,), queue=cleanup_settings().release_queue, retries=1
            )
        fleet.wait_until(
            lambda: fleet.outcome_counts() == {"released": 5}, timeout=60, what="released"
        )
        # then: the delivery counts are read from PostgreSQL, not from that Redis; nothing
        # was dead-lettered
        assert fleet.log_lines([worker.log_path], "delivery counter unavailable") == []
    assert DeadLetter.objects.count() == 0
    assert fleet.invariant_violations(expected_released=ids) == []
    assert fleet.scalar("SELECT count(*) FROM cleanup_cleanupreceipt WHERE attempt = 2") == 5


def _waiting(pid: int) -> bool:
    return bool(
        fleet.scalar("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", [pid])
    )


def test_a_release_that_races_a_concurrent_writer_raises_transient_conflict_and_is_retried(
    clean, exclusive_workers, tmp_path: Path
) -> None:
    """Three real connections and PostgreSQL's own ordering, no clock and no patch:

    1. connection A moves the hold's expiry an hour ahead (not committed): the worker's release
       UPDATE, which saw the hold eligible, waits on its row lock;
    2. connection B asks for the table in ACCESS EXCLUSIVE mode: it queues behind both;
    3. A commits: the release re-checks the row (expiry ahead: nothing released) and ends; B
       gets the table first, so the release's next statement (why nothing was released) waits;
    4. B puts the expiry back and commits: that statement sees the hold held, at the message's
       version and expired — the ``TransientConflict`` of ``classify_no_release``.
    The worker retries it, and the second attempt releases the hold."""
    hold_id, _ = fleet.one_eligible_hold()
    original = fleet.scalar(
        "SELECT expires_at FROM reservations_reservation WHERE id = %s", [hold_id]
    )
    with fleet.dedicated(tmp_path, {"env": FAILING_ENV}) as (worker,):
        a = psycopg.connect(fleet.conninfo())
        b = psycopg.connect(fleet.conninfo())
        try:
            a.execute(
                "UPDATE reservations_reservation SET expires_at = now() + interval '1 hour' "
                "WHERE id = %s",
                [hold_id],
            )
            message = fleet.publish_for(hold_id)
            (release_pid,) = fleet.wait_until(
                fleet.blocked_backends, timeout=30, what="the release waiting on the row"
            )
            b_pid = b.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            locker = threading.Thread(
                target=b.execute,
                args=("LOCK TABLE reservations_reservation IN ACCESS EXCLUSIVE MODE",),
            )
            locker.start()
            fleet.wait_until(lambda: _waiting(b_pid), timeout=30, what="B queued for the table")
            a.commit()
            locker.join(30)
            assert not locker.is_alive()
            fleet.wait_until(
                lambda: _waiting(release_pid), timeout=30, what="the release's second statement"
            )
            b.execute(
                "UPDATE reservations_reservation SET expires_at = %s WHERE id = %s",
                [original, hold_id],
            )
            b.commit()
        finally:
            a.close()
            b.close()
        fleet.wait_until(
            lambda: fleet.status_of(hold_id) == "released", timeout=60, what="released"
        )
        retried = fleet.log_lines([worker.log_path], "transient failure, retrying")
    # then: one retry, for the conflict; released once, by the second attempt; no letter
    assert len(retried) == 1 and "TransientConflict" in retried[0]
    assert fleet.sql(
        "SELECT outcome, attempt FROM cleanup_cleanupreceipt WHERE idempotency_key = %s",
        [message["idempotency_key"]],
    ) == [("released", 2)]
    assert DeadLetter.objects.count() == 0
    assert fleet.invariant_violations(expected_released=[hold_id]) == []
