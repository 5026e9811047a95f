"""A worker killed in the middle of a sweep, with real workers: the sweep publishes a batch
before its claim commits, so a sweep that dies inside that transaction leases nothing without
a message (cleanup/release/sweep.py; docs/PIPELINE.md, invariant 5).

Two kill points, each parked deterministically inside the claim's transaction:
- before the publish: the test locks the dead-letter table, and the batch holds a hold that
  this claim sets aside, whose dead letter the sweep writes before it publishes;
- between the publish and the commit: a deferred constraint trigger on the holds, which runs at
  COMMIT, waits for an advisory lock the test holds. A sweep that published after its claim
  committed would be parked with nothing published, and killed there, or anywhere in its
  publish, would leave holds leased without a message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from tests.support import fleet

pytestmark = [pytest.mark.workers]


@contextmanager
def dead_letters_locked() -> Iterator[None]:
    """Hold a lock on the dead-letter table that blocks every INSERT until the block ends."""
    conn = psycopg.connect(fleet.conninfo())
    try:
        conn.execute("LOCK TABLE cleanup_deadletter IN SHARE ROW EXCLUSIVE MODE")
        yield
    finally:
        conn.rollback()
        conn.close()


# A bigint advisory key of the test's own: the product's locks use the two-int key space.
COMMIT_PARK_KEY = 0x5EED_C0DE


@contextmanager
def claim_commits_parked() -> Iterator[None]:
    """Park every COMMIT that updated a hold until the block ends: a deferred constraint
    trigger (run at COMMIT, after the transaction's last statement) waits for an advisory lock
    the test holds. The trigger is dropped at the end; call this with no worker running
    releases, since their commits would park too."""
    holder = psycopg.connect(fleet.conninfo(), autocommit=True)
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", [COMMIT_PARK_KEY])
        holder.execute(
            "CREATE FUNCTION test_park_commit() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN PERFORM pg_advisory_xact_lock({COMMIT_PARK_KEY}); RETURN NULL; END $$"
        )
        holder.execute(
            "CREATE CONSTRAINT TRIGGER test_park_commit AFTER UPDATE ON reservations_reservation "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_park_commit()"
        )
        yield
    finally:
        holder.execute("SELECT pg_advisory_unlock_all()")
        holder.execute("DROP TRIGGER IF EXISTS test_park_commit ON reservations_reservation")
        holder.execute("DROP FUNCTION IF EXISTS test_park_commit()")
        holder.close()


def test_a_worker_killed_mid_sweep_leaves_its_batch_due_at_once_not_leased(
    clean, exclusive_workers, tmp_path
):
    """A sweep publishes a batch before its claim commits, so a worker that dies inside that
    transaction leases nothing without a message: the claim rolls back and the next sweep takes
    the same holds at once, not after CLEANUP_LEASE_SECONDS."""
    # given: 20 eligible holds, one claimed so often that this claim sets it aside; the test
    # locks the dead-letter table, so the sweep parks inside its claim's transaction (writing
    # that hold's dead letter), after the claim and before the publish
    ids = fleet.create_eligible_holds(20, offerings=2)
    worn, others = ids[0], ids[1:]
    limit = cleanup_settings().max_claims
    fleet.sql("UPDATE reservations_reservation SET claim_count = %s WHERE id = %s", [limit, worn])
    with fleet.dedicated(tmp_path, {"concurrency": 1}) as (sweeper,):
        with dead_letters_locked():
            fleet.run_sweeps(1)
            backends = fleet.wait_until(fleet.blocked_backends, timeout=30, what="the sweep parked")
            # when: the whole worker is SIGKILLed inside that transaction (and the server
            # ends its session, as it would once the client is found gone)
            sweeper.kill()
            assert fleet.scalar("SELECT pg_terminate_backend(%s)", [backends[0]]) is True
        fleet.wait_until(lambda: not fleet.blocked_backends(), timeout=30, what="the session ended")
    # then: the claim rolled back: nothing is leased, everything is due now
    assert set(fleet.claim_counts(others).values()) == {0}
    assert fleet.claim_counts([worn]) == {worn: limit}
    due = (
        "SELECT count(*) FROM reservations_reservation "
        "WHERE id = ANY(%s) AND next_attempt_at <= now()"
    )
    assert fleet.scalar(due, [ids]) == len(ids)
    assert fleet.outcome_counts() == {}
    # and when another worker sweeps, each hold is claimed once more and released, and the
    # worn hold is set aside once, with one dead letter
    with fleet.dedicated(tmp_path, {"concurrency": 1}):
        fleet.sweep_until(lambda: fleet.released_count(others) == len(others), shards=1, timeout=60)
    assert set(fleet.claim_counts(others).values()) == {1}
    set_aside = DeadLetter.objects.filter(
        reservation_id=worn, reason=DeadLetter.Reason.CLAIMS_EXHAUSTED
    )
    assert set_aside.count() == 1
    assert fleet.status_of(worn) == "held"
    assert fleet.invariant_violations(expected_released=others, expected_not_released=[worn]) == []


def test_a_worker_killed_between_the_publish_and_the_commit_leaves_messages_that_release_all(
    clean, exclusive_workers, tmp_path
):
    """The sweep's messages are on the queue before its claim commits: a worker killed at the
    commit leaves no hold leased (the claim rolls back) and every hold with its message, which
    releases it without another sweep."""
    from cleanup.broker.readers import queue_depth

    # given: 20 eligible holds, and every commit that updates a hold parked until the test
    # lets it go (so the sweep stops after its last statement, at COMMIT)
    ids = fleet.create_eligible_holds(20, offerings=2)
    with fleet.dedicated(tmp_path, {"concurrency": 1}) as (sweeper,):
        with claim_commits_parked():
            fleet.run_sweeps(1)
            backends = fleet.wait_until(
                fleet.blocked_backends, timeout=30, what="the sweep parked at its commit"
            )
            # then: the whole batch is already published while the claim is uncommitted (a
            # quorum queue counts a message once its replicas have it, a moment after the
            # publish: waited for, briefly; its prefetch is per consumer, so the worker may
            # hold one release message besides the sweep it runs)
            queue = cleanup_settings().release_queue
            fleet.wait_until(
                lambda: queue_depth(queue) + (fleet.unacked(queue) or 0) == len(ids),
                timeout=5,
                interval=0.1,
                what="the sweep's whole batch published before its commit",
            )
            # when: the whole worker is SIGKILLed at that commit (and the server ends its
            # session, as it would once the client is found gone)
            sweeper.kill()
            assert fleet.scalar("SELECT pg_terminate_backend(%s)", [backends[0]]) is True
            fleet.wait_until(
                lambda: not fleet.blocked_backends(), timeout=30, what="the session ended"
            )
    # then: the claim rolled back: nothing is leased, everything is due now
    assert set(fleet.claim_counts(ids).values()) == {0}
    due = (
        "SELECT count(*) FROM reservations_reservation "
        "WHERE id = ANY(%s) AND next_attempt_at <= now()"
    )
    assert fleet.scalar(due, [ids]) == len(ids)
    # and when a worker consumes only the release queue (no sweep can run), the messages the
    # dead sweep published release every hold, each once
    with fleet.dedicated(
        tmp_path, {"concurrency": 1, "extra_args": ["-Q", cleanup_settings().release_queue]}
    ):
        fleet.wait_until(
            lambda: fleet.released_count(ids) == len(ids),
            timeout=60,
            what="the published messages to release every hold",
        )
    assert fleet.outcome_counts() == {"released": len(ids)}
    assert fleet.invariant_violations(expected_released=ids) == []
