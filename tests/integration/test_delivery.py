"""Delivery semantics with real workers: a killed pool child, a killed worker, a terminated
database connection, and malformed input of every kind that reaches a worker.

Each blocking scenario parks a release mid-transaction deterministically: the test holds the
offering's row lock from its own connection, so the worker's release statement waits inside
its transaction; the test then kills or disconnects what it needs to and lets go of the lock.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from typing import Any

import psycopg
import pytest
from django.conf import settings

from cleanup.broker import queues
from cleanup.broker import readers as broker
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import delivery_cap
from tests.support import fleet
from tests.support.fleet import (
    blocked_backends,
    broker_counts_redeliveries,
    broker_is_redis,
    create_eligible_holds,
    dedicated,
    invariant_violations,
    offering_locked,
    one_eligible_hold,
    outcome_counts,
    publish_for,
    queue_settled,
    rabbitmq_policy,
    scalar,
    status_of,
    wait_until,
)
from tests.support.missing_tools import leave_out
from tests.support.wire import GOOD, publish_raw
from tests.support.wire import task_body as _body

pytestmark = [pytest.mark.workers]

POISON = ["-I", "tests.support.poison_tasks"]


@pytest.mark.skipif(
    not fleet.PGBOUNCER, reason="only behind a PgBouncer (RESERVATIONS_TEST_PGBOUNCER)"
)
def test_behind_pgbouncer_the_workers_really_reach_the_database_through_it(clean, workers):
    # given: the suites' processes sent through a PgBouncer in transaction pooling
    # (noxfile.py, session pgbouncer)
    hold_id, _ = one_eligible_hold()
    # when: a worker releases a hold
    publish_for(hold_id)
    wait_until(lambda: status_of(hold_id) == "released", timeout=60, what="released")
    # then: PgBouncer's admin console lists the workers' connections to the tests' database
    # (Django keeps them open for DATABASE_CONN_MAX_AGE)
    host, _, port = fleet.PGBOUNCER.partition(":")
    database = settings.DATABASES["default"]["NAME"]
    user = str(settings.DATABASES["default"]["USER"])
    with psycopg.connect(
        host=host, port=port, dbname="pgbouncer", user=user, autocommit=True
    ) as admin:
        clients = admin.execute("SHOW CLIENTS").fetchall()
    assert [c for c in clients if c[2] == database], clients


def test_a_pool_child_killed_mid_release_is_redelivered_and_released_once(
    clean, exclusive_workers, tmp_path
):
    # given: one worker, one pool process, the release parked inside its transaction; a
    # visibility timeout far beyond the test's deadlines, so a redelivery can only come from
    # the worker's main process requeueing the message (reject_on_worker_lost)
    hold_id, offering_id = one_eligible_hold()
    long_visibility = {"CLEANUP_VISIBILITY_TIMEOUT": "3600"}
    with dedicated(tmp_path, {"concurrency": 1, "env": long_visibility}) as (worker,):
        with offering_locked(offering_id):
            key = publish_for(hold_id)["idempotency_key"]
            wait_until(blocked_backends, timeout=30, what="release waiting on the row lock")
            children = worker.children()
            assert len(children) == 1
            # when: the pool child dies mid-task (SIGKILL, no cleanup at all)
            killed_at = time.monotonic()
            os.kill(children[0], signal.SIGKILL)
            wait_until(lambda: worker.children() and worker.children() != children, timeout=30)
        # then: reject_on_worker_lost puts the message back at once and a new child handles
        # it (its orphaned statement may have committed meanwhile: then already_handled)
        # (a redelivery is counted; the first delivery was not; from a quorum queue the
        # broker counts it in the message itself, and no counter is written)
        if not broker_counts_redeliveries():
            wait_until(lambda: delivery_cap.current(key) >= 1, timeout=60, what="redelivery")
        wait_until(lambda: status_of(hold_id) == "released", timeout=60, what="released")
        recovery = time.monotonic() - killed_at
    print(f"\npool child SIGKILL: message redelivered and handled after {recovery:.2f}s")
    assert outcome_counts() == {"released": 1}
    assert invariant_violations(expected_released=[hold_id]) == []
    receipt_attempt = scalar("SELECT attempt FROM cleanup_cleanupreceipt")
    assert receipt_attempt == 1  # a redelivery, not a Celery retry
    # one redelivery: two deliveries in all
    assert delivery_cap.current(key) == (0 if broker_counts_redeliveries() else 1)


def _backend_exists(pid: int) -> bool:
    return bool(scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]))


@pytest.mark.parametrize("orphan_statement", ["commits", "is_aborted"])
def test_a_worker_killed_whole_mid_release_is_recovered_by_another_worker(
    clean, exclusive_workers, tmp_path, orphan_statement
):
    """The release is one autocommit statement. When its worker dies while the statement waits
    on a lock, PostgreSQL may still finish it (it notices the dead client only when it answers)
    or the server may drop it; either way the message comes back after the visibility timeout
    and the hold is released exactly once."""
    # given: worker A parks the release inside its statement; worker B starts later
    hold_id, offering_id = one_eligible_hold()
    message = None
    with dedicated(tmp_path, {"concurrency": 1}) as (worker_a,):
        with offering_locked(offering_id):
            message = publish_for(hold_id)
            backends = wait_until(blocked_backends, timeout=30, what="release waiting")
            # when: the whole worker (main process and child) is SIGKILLed: no Celery code
            # runs, the message stays in kombu's unacked set
            killed_at = time.monotonic()
            worker_a.kill()
            if orphan_statement == "is_aborted":
                assert scalar("SELECT pg_terminate_backend(%s)", [backends[0]]) is True
        if orphan_statement == "commits":
            wait_until(lambda: status_of(hold_id) == "released", timeout=30, what="orphan commit")
        else:
            # the terminated backend is gone: its statement can no longer commit
            wait_until(lambda: not _backend_exists(backends[0]), timeout=30,
                       what="the terminated backend to exit")  # fmt: skip
            assert status_of(hold_id) == "held"
        # the message is not lost, and no consumer runs now: on Redis it waits in kombu's
        # unacked set for the visibility timeout; RabbitMQ puts it back in the queue as soon
        # as the dead worker's connection closes
        queue = cleanup_settings().release_queue
        if broker_is_redis():
            assert (broker.queue_depth(queue), broker.unacked_count(queue)) == (0, 1)
        else:
            wait_until(
                lambda: broker.queue_depth(queue) == 1,
                timeout=30,
                what="RabbitMQ to requeue the dead worker's delivery",
            )
        with dedicated(tmp_path, {"concurrency": 1}):
            # then: after the visibility timeout another worker's restore scan brings the
            # message back, and it is handled (released, or already_handled)
            key = message["idempotency_key"]
            # the restored message is marked redelivered, so it is counted (by the broker
            # itself from a quorum queue)
            if not broker_counts_redeliveries():
                wait_until(lambda: delivery_cap.current(key) >= 1, timeout=90, what="redelivery")
            wait_until(lambda: status_of(hold_id) == "released", timeout=30, what="released")
            recovery = time.monotonic() - killed_at
            wait_until(lambda: queue_settled(cleanup_settings().release_queue), timeout=30)
    how = (
        f"visibility timeout {cleanup_settings().visibility_timeout}s, restore scan every "
        f"{cleanup_settings().unacked_restore_interval}s"
        if broker_is_redis()
        else "RabbitMQ requeues on connection loss; includes the second worker's start"
    )
    print(
        f"\nwhole-worker SIGKILL, orphan statement {orphan_statement}: message redelivered "
        f"and handled after {recovery:.2f}s ({how})"
    )
    assert outcome_counts() == {"released": 1}
    assert invariant_violations(expected_released=[hold_id]) == []
    if broker_is_redis():
        # it came back through the visibility timeout (never before it): the restore path, not
        # a requeue by the dead worker. How long after is printed above, not asserted. (On
        # RabbitMQ the requeue on connection loss is seen above, before any worker ran.)
        assert recovery >= cleanup_settings().visibility_timeout - 1


def test_a_retry_with_a_countdown_comes_back_when_due_and_releases_its_hold(
    clean, exclusive_workers, tmp_path
):
    """A retry as the release tasks' backoff sends it (``retries`` above 0, a countdown): on
    Redis and classic queues the worker holds it until it is due; with quorum queues it waits
    in Celery's native delayed-delivery queues and comes back through their exchanges
    (cleanup.broker.queues), which the routing checks must let through to the release queue."""
    from celery import current_app

    from cleanup.release.messages import ReleaseMessage
    from cleanup.wire import RELEASE_TASK
    from tests.support.wire import send_signed

    hold_id, _ = one_eligible_hold()
    expires_at = scalar("SELECT expires_at FROM reservations_reservation WHERE id = %s", [hold_id])
    message = ReleaseMessage.for_hold(hold_id, 1, expires_at, 0, "retry-countdown").as_dict()
    with dedicated(tmp_path, {"concurrency": 1}):
        sent = time.monotonic()
        send_signed(
            current_app,
            RELEASE_TASK,
            (message,),
            queue=cleanup_settings().release_queue,
            countdown=2,
            retries=1,
        )
        wait_until(lambda: status_of(hold_id) == "released", timeout=30, what="released")
        took = time.monotonic() - sent
    print(f"\nretry with a 2 s countdown released after {took:.2f}s")
    assert took >= 1.0  # not at once (native delayed delivery counts whole seconds)
    assert outcome_counts() == {"released": 1}
    assert DeadLetter.objects.count() == 0
    assert scalar("SELECT attempt FROM cleanup_cleanupreceipt") == 2  # the retry's attempt


def test_a_terminated_database_connection_is_retried_then_released_once(
    clean, exclusive_workers, tmp_path
):
    # given
    hold_id, offering_id = one_eligible_hold()
    with dedicated(tmp_path, {"concurrency": 1}):
        with offering_locked(offering_id):
            publish_for(hold_id)
            backends = wait_until(blocked_backends, timeout=30, what="release waiting")
            # when: the worker's connection is terminated mid-transaction
            assert scalar("SELECT pg_terminate_backend(%s)", [backends[0]]) is True
            # gone before the lock is let go, so its statement fails instead of committing
            wait_until(lambda: not _backend_exists(backends[0]), timeout=30,
                       what="the terminated backend to exit")  # fmt: skip
        # then: a transient error → Celery retry with backoff → released once
        wait_until(lambda: status_of(hold_id) == "released", timeout=60, what="released")
    assert outcome_counts() == {"released": 1}
    assert scalar("SELECT attempt FROM cleanup_cleanupreceipt") == 2
    assert invariant_violations(expected_released=[hold_id]) == []
    assert DeadLetter.objects.count() == 0


@pytest.mark.skipif(broker_is_redis(), reason="publisher confirms are RabbitMQ's")
def test_a_retry_rabbitmq_refuses_requeues_the_delivery_and_the_hold_is_released_once(
    clean, exclusive_workers, tmp_path
):
    # given: a release waiting on a locked offering, and the queue its retry goes to refusing
    # everything
    if queues.is_quorum(cleanup_settings()):
        leave_out(
            "quorum queues",
            "a quorum queue takes the first message past its length limit, and a retry's first "
            "stop (a delayed-delivery queue) is empty: the broker cannot be made to refuse it",
        )
    hold_id, offering_id = one_eligible_hold()
    full = {"max-length": 0, "overflow": "reject-publish"}
    with dedicated(tmp_path, {"concurrency": 1}) as (worker,):
        with offering_locked(offering_id):
            publish_for(hold_id)
            backends = wait_until(blocked_backends, timeout=30, what="release waiting")
            with rabbitmq_policy("retry-refused", cleanup_settings().release_queue, full):
                # when: a transient error makes the release retry, and the broker refuses it
                assert scalar("SELECT pg_terminate_backend(%s)", [backends[0]]) is True
                refused = wait_until(
                    lambda: fleet.log_lines([worker.log_path], "retry not confirmed"),
                    timeout=30,
                    what="the refused retry logged",
                )
            # then: the delivery was requeued, not dropped: it is back, waiting on the lock
            wait_until(blocked_backends, timeout=30, what="the requeued release waiting")
        # and released once the offering is free, once, without a lease or a dead letter
        wait_until(lambda: status_of(hold_id) == "released", timeout=60, what="released")
    assert "basic.nack" in refused[0], refused
    assert outcome_counts() == {"released": 1}
    assert invariant_violations(expected_released=[hold_id]) == []
    assert DeadLetter.objects.count() == 0
    assert scalar("SELECT claim_count FROM reservations_reservation WHERE id = %s", [hold_id]) <= 1


# --- malformed input ----------------------------------------------------------------------

MALFORMED: dict[str, tuple[dict[str, Any], str, str]] = {
    # name: (publish kwargs, expected dead-letter reason, words in the error)
    "non-JSON body": ({"body": b"this is {not json"}, "rejected", "undecodable"),
    "pickle content type": (
        {
            "body": b"\x80\x04K\x01.",
            "content_type": "application/x-python-serialize",
            "encoding": "binary",
        },
        "rejected",
        # refused by its content type before kombu is asked to decode it
        "content type 'application/x-python-serialize' is not 'application/json'",
    ),
    "unknown task name": (
        {"body": _body(GOOD), "task": "cleanup.no_such_task"},
        "unknown_task",
        "no_such_task",
    ),
    "no task headers": ({"body": _body(GOOD), "task": None}, "rejected", "not a task message"),
    "body is an object, not [args, kwargs, embed]": (
        {"body": json.dumps({"a": 1})},
        "rejected",
        "[args, kwargs, embed]",
    ),
    "missing argument": ({"body": _body()}, "malformed", "missing a required argument"),
    "extra argument": ({"body": _body(GOOD, 2)}, "malformed", "too many positional"),
    "message is a string": ({"body": _body("hello")}, "malformed", "JSON object"),
    "missing field": (
        {"body": _body({k: v for k, v in GOOD.items() if k != "reservation_id"})},
        "malformed",
        "missing field 'reservation_id'",
    ),
    "id is a string": (
        {"body": _body({**GOOD, "reservation_id": "1"})},
        "malformed",
        "must be an integer",
    ),
    "version is a bool": ({"body": _body({**GOOD, "version": True})}, "malformed", "got bool"),
    "key does not match": (
        {"body": _body({**GOOD, "idempotency_key": "release:2:1"})},
        "malformed",
        "does not match",
    ),
    "unknown schema version": (
        {"body": _body({**GOOD, "schema_version": 2})},
        "malformed",
        "schema_version",
    ),
    "expiry is not a time": (
        {"body": _body({**GOOD, "expires_at": "yesterday"})},
        "malformed",
        "ISO 8601",
    ),
    "poison: kills its worker": (
        {
            "body": _body({"idempotency_key": f"poison:{uuid.uuid4().hex}"}),
            "task": "tests.poison_kills_worker",
        },
        "deliveries_exhausted",
        "delivered",
    ),
}


def test_malformed_messages_are_dead_lettered_with_a_reason_and_valid_ones_keep_flowing(
    clean, exclusive_workers, tmp_path
):
    # given: two workers that cap deliveries at 3 and can run the poison task
    env = {"CLEANUP_MAX_RETRIES": "2"}
    capped = {"CLEANUP_MAX_DELIVERIES": 3}
    holds = create_eligible_holds(50, offerings=2)
    with dedicated(
        tmp_path,
        {"concurrency": 2, "extra_args": POISON, "env": env, "settings": capped},
        {"concurrency": 2, "extra_args": POISON, "env": env, "settings": capped},
    ):
        # when: every kind of bad input is published raw, between valid messages
        task_ids = {}
        for i, (name, (kwargs, _reason, _words)) in enumerate(MALFORMED.items()):
            kwargs = dict(kwargs)
            body = kwargs.pop("body")
            task_ids[name] = publish_raw(body, **kwargs)
            publish_for(holds[i])
        for hold_id in holds[len(MALFORMED) :]:
            publish_for(hold_id)
        # then
        wait_until(
            lambda: DeadLetter.objects.count() >= len(MALFORMED), timeout=120, what="dead letters"
        )
        wait_until(
            lambda: outcome_counts().get("released", 0) == len(holds),
            timeout=60,
            what="valid releases",
        )
    letters = list(DeadLetter.objects.all())
    assert len(letters) == len(MALFORMED), [(d.reason, d.error[:60]) for d in letters]
    by_task = {d.task_id: d for d in letters}
    for name, (_kwargs, reason, words) in MALFORMED.items():
        if name == "no task headers":
            letter = next(d for d in letters if "no 'task' header" in d.error)
        else:
            letter = by_task[task_ids[name]]
        assert letter.reason == reason, name
        assert words in letter.error, (name, letter.error)
        assert letter.payload, name
    poison = by_task[task_ids["poison: kills its worker"]]
    assert poison.delivery_count == 4  # three deliveries ran, the fourth was set aside
    assert invariant_violations(expected_released=holds) == []
