"""Failure paths driven with real components: real ``celery worker`` and ``celery beat``
processes, PostgreSQL sessions ended with ``pg_terminate_backend``, triggers raising a real
SQLSTATE, and a private ``redis-server`` on a free port, killed and started again (never the
shared one).

- A sweep whose database connection is killed mid-claim: one ``periodic_failed`` letter that
  names the original error (not the error of releasing the sweep's locks on the dead
  connection), that says why it cannot be requeued, and that the next successful sweep of the
  same shard settles — so the open-letter alert clears without a person.
- The outbox relay failing mid-batch (after publishing, before marking), a health sample and a
  prune that cannot be written: each one ``periodic_failed`` letter its next success settles.
- A failure whose dead letter cannot be written (the letter's INSERT ends its own session): the
  message is not lost with its letter; it is delivered again, and releases the hold once the
  database takes writes again.
- A release raising ``TransientConflict`` against real concurrent writers: in
  ``test_task_failures.py``.
- Redis killed under a worker waiting in the screened transport's BRPOP; ``/readyz`` and
  ``requeue_dead_letters`` with the broker down; a beat whose lease connection is refused.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from cleanup.models import DeadLetter
from cleanup.operations import triage
from cleanup.release import dead_letters, locks
from tests.support import fleet

pytestmark = [pytest.mark.workers]

# Retries end within seconds (the retry of a message whose letter was not stored waits the
# longest backoff); enough deliveries that the test, not the bound, ends the kept message's loop.
# A sweep waits in line for the publish lock for CLEANUP_SWEEP_LOCK_WAIT (2 s by default), then
# ends its run: 10 s (below the sweep's 12.5 s time budget) keeps the parked sweep in line long
# enough for the test to find its session in pg_locks and end it.
ENV = {"CLEANUP_MAX_RETRIES": "1", "CLEANUP_RETRY_BACKOFF_MAX": "1"}
# The tuning settings (Django settings of the worker's, not variables).
TUNED = {"CLEANUP_MAX_DELIVERIES": 40, "CLEANUP_SWEEP_LOCK_WAIT": 10}
WORKER = {"env": ENV, "settings": TUNED}


@contextmanager
def reservations_locked() -> Iterator[psycopg.Connection[Any]]:
    """An ACCESS EXCLUSIVE lock on the holds' table from the test's own connection: a sweep's
    claim waits on it, inside the claim's transaction, holding the publish lock."""
    conn = psycopg.connect(fleet.conninfo())
    try:
        conn.execute("LOCK TABLE reservations_reservation IN ACCESS EXCLUSIVE MODE")
        yield conn
    finally:
        conn.rollback()
        conn.close()


def terminate(pids: list[int]) -> None:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", [pids])


def open_letters() -> list[DeadLetter]:
    return list(DeadLetter.objects.filter(resolved_at__isnull=True).order_by("id"))


@contextmanager
def publish_lock_taken() -> Iterator[psycopg.Connection[Any]]:
    """The sweeps' publish lock held by the test's own session: a sweep waits in line for it
    (a blocking pg_advisory_lock under lock_timeout), holding its shard lock, outside any
    transaction."""
    conn = psycopg.connect(fleet.conninfo(), autocommit=True)
    try:
        conn.execute("SELECT pg_advisory_lock(%s, %s)", list(locks.SWEEP_PUBLISH))
        yield conn
    finally:
        conn.close()


def sweeps_waiting_for_the_publish_lock() -> list[int]:
    """Sessions PostgreSQL shows waiting (not granted) for the publish lock. A two-key advisory
    lock appears in pg_locks as classid = first key, objid = second key, objsubid = 2."""
    first, second = locks.SWEEP_PUBLISH
    rows = fleet.sql(
        "SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
        "WHERE d.datname = current_database() AND l.locktype = 'advisory' "
        "AND l.classid = %s AND l.objid = %s AND l.objsubid = 2 AND NOT l.granted "
        "AND l.pid <> pg_backend_pid()",
        [first, second],
    )
    return [r[0] for r in rows]


# Where the sweep's session is ended: inside its claim's transaction, or while it waits in line
# for the publish lock with its shard lock held (where resetting the wait's lock_timeout, or
# releasing the shard lock, on the dead connection raised "the connection is closed", which
# became the letter's error).
WHERE = {
    "in its claim": (reservations_locked, fleet.blocked_backends),
    "waiting for the publish lock": (publish_lock_taken, sweeps_waiting_for_the_publish_lock),
}


@pytest.mark.parametrize("where", list(WHERE))
def test_a_sweep_whose_connection_dies_is_a_periodic_letter_the_next_sweep_settles(
    clean, exclusive_workers, tmp_path: Path, where: str
) -> None:
    parking, parked_sweeps = WHERE[where]
    ids = fleet.create_eligible_holds(6, offerings=2)
    with fleet.dedicated(tmp_path, WORKER) as (worker,):
        # given: a sweep parked (a lock the test holds), its session then terminated
        with parking():
            fleet.run_sweeps(1)
            parked = fleet.wait_until(parked_sweeps, timeout=60, what=f"the sweep {where}")
            terminate(parked)
            fleet.wait_until(open_letters, timeout=60, what="the sweep's dead letter")
        (letter,) = open_letters()
        # then: a periodic letter naming the error that ended the sweep, nothing claimed
        assert letter.reason == DeadLetter.Reason.PERIODIC_FAILED
        assert letter.task_name == "cleanup.sweep_shard"
        assert "terminating connection due to administrator command" in letter.error
        assert letter.idempotency_key == "periodic:cleanup.sweep_shard:shard=0,shards=1"
        assert fleet.released_count(ids) == 0
        assert set(fleet.claim_counts(ids).values()) == {0}  # the claim rolled back
        # and: requeue says why it cannot send it, and a release settles nothing
        (result,) = triage.requeue([letter]).keys()
        assert result.startswith("not_requeueable (a periodic task")
        assert dead_letters.resolve_released() == 0
        assert len(open_letters()) == 1
        # when: the next tick's sweep of the same shard succeeds
        fleet.run_sweeps(1)
        fleet.wait_until(
            lambda: fleet.released_count(ids) == len(ids), timeout=60, what="holds released"
        )
        fleet.wait_until(lambda: not open_letters(), timeout=30, what="the periodic letter settled")
        # and the worker logged the lock it could not release, not instead of the error
        unlock_lines = fleet.log_lines([worker.log_path], "sweep lock not released")
    letter.refresh_from_db()
    assert letter.resolution == dead_letters.SUCCEEDED_LATER
    assert letter.resolved_by == dead_letters.AUTOMATIC
    print(f"\nsweep killed {where}: lock releases on the dead connection: {unlock_lines}")
    assert fleet.invariant_violations(expected_released=ids) == []


LETTERS_FAIL = """
CREATE FUNCTION failure_real_release() RETURNS trigger AS $$
BEGIN
  RAISE EXCEPTION 'injected release failure' USING ERRCODE = 'P0001';
END $$ LANGUAGE plpgsql;
CREATE TRIGGER failure_real_release BEFORE UPDATE ON reservations_reservation
  FOR EACH ROW WHEN (NEW.status = 'released') EXECUTE FUNCTION failure_real_release();
CREATE FUNCTION failure_real_letter() RETURNS trigger AS $$
BEGIN
  -- the letter's own session ends, as when the server goes away mid-write
  PERFORM pg_terminate_backend(pg_backend_pid());
  PERFORM pg_sleep(5);
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER failure_real_letter BEFORE INSERT ON cleanup_deadletter
  FOR EACH ROW EXECUTE FUNCTION failure_real_letter();
"""
LETTERS_FAIL_UNDO = """
DROP TRIGGER IF EXISTS failure_real_release ON reservations_reservation;
DROP FUNCTION IF EXISTS failure_real_release();
DROP TRIGGER IF EXISTS failure_real_letter ON cleanup_deadletter;
DROP FUNCTION IF EXISTS failure_real_letter();
"""


def test_a_failure_whose_dead_letter_cannot_be_written_keeps_its_message(
    clean, exclusive_workers, tmp_path: Path
) -> None:
    hold_id, _ = fleet.one_eligible_hold()
    try:
        with connection.cursor() as cur:
            cur.execute(LETTERS_FAIL)
        with fleet.dedicated(tmp_path, WORKER) as (worker,):
            # given: a release that fails, and a dead letter whose write loses its connection
            message = fleet.publish_for(hold_id)
            kept = "dead letter not stored: message sent again"
            fleet.wait_until(
                lambda: len(fleet.log_lines([worker.log_path], kept)) >= 2,
                timeout=60,
                what="the message kept across two failed letters",
            )
            # then: nothing was acknowledged away — no letter, the hold still held
            assert DeadLetter.objects.count() == 0
            assert fleet.status_of(hold_id) == "held"
            # when: the database takes writes again
            with connection.cursor() as cur:
                cur.execute(LETTERS_FAIL_UNDO)
            fleet.wait_until(
                lambda: fleet.status_of(hold_id) == "released", timeout=60, what="released"
            )
            attempts = fleet.log_lines([worker.log_path], kept)
    finally:
        with connection.cursor() as cur:
            cur.execute(LETTERS_FAIL_UNDO)
    # then: the same message released the hold, once, on a later delivery
    receipt = fleet.sql(
        "SELECT outcome, attempt FROM cleanup_cleanupreceipt WHERE idempotency_key = %s",
        [message["idempotency_key"]],
    )
    print(f"\nletters not stored before the release went through: {len(attempts)}")
    assert receipt[0][0] == "released" and receipt[0][1] > len(attempts) >= 2
    assert DeadLetter.objects.count() == 0
    assert fleet.invariant_violations(expected_released=[hold_id]) == []


# --- a periodic task raising in a real worker: the outbox relay mid-batch, a health sample ---

FAIL_ON = """
CREATE FUNCTION failure_real_periodic() RETURNS trigger AS $$
BEGIN
  RAISE EXCEPTION 'injected periodic failure' USING ERRCODE = 'P0001';
END $$ LANGUAGE plpgsql;
CREATE TRIGGER failure_real_periodic BEFORE {event} ON {table}
  FOR EACH ROW EXECUTE FUNCTION failure_real_periodic();
"""


@contextmanager
def failing(event: str, table: str) -> Iterator[None]:
    with connection.cursor() as cur:
        cur.execute(FAIL_ON.format(event=event, table=table))
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute(
                f"DROP TRIGGER IF EXISTS failure_real_periodic ON {table}; "
                "DROP FUNCTION IF EXISTS failure_real_periodic()"
            )


def letter_of_a_failing_run(task: Any, event: str, table: str) -> DeadLetter:
    """Runs the periodic ``task`` once while its ``event`` on ``table`` raises; its one open
    letter, checked to be a periodic failure carrying the injected error."""
    with failing(event, table):
        task.apply_async()
        fleet.wait_until(open_letters, timeout=60, what=f"{task.name}'s dead letter")
    (letter,) = open_letters()
    assert letter.reason == DeadLetter.Reason.PERIODIC_FAILED
    assert "injected periodic failure" in letter.error
    return letter


def test_an_outbox_relay_failing_mid_batch_publishes_again_and_its_letter_clears(
    clean, exclusive_workers, tmp_path: Path
) -> None:
    from cleanup.broker.readers import queue_depth
    from cleanup.conf import cleanup_settings
    from cleanup.tasks import relay_outbox_task

    ids = fleet.create_eligible_holds(3, offerings=1)
    events = cleanup_settings().events_queue
    unpublished = "SELECT count(*) FROM reservations_outboxevent WHERE published_at IS NULL"
    with fleet.dedicated(tmp_path, WORKER):
        fleet.run_sweeps(1)
        fleet.wait_until(lambda: fleet.released_count(ids) == 3, timeout=60, what="released")
        assert fleet.scalar(unpublished) == 3
        # given: the relay publishes the batch, then marking it published fails
        letter = letter_of_a_failing_run(relay_outbox_task, "UPDATE", "reservations_outboxevent")
        assert letter.task_name == "cleanup.relay_outbox"
        # then: the events went out, none is marked: the next relay sends them again
        assert queue_depth(events) == 3
        assert fleet.scalar(unpublished) == 3
        # when: the next relay succeeds
        relay_outbox_task.apply_async()
        fleet.wait_until(lambda: fleet.scalar(unpublished) == 0, timeout=60, what="relayed")
        fleet.wait_until(lambda: not open_letters(), timeout=30, what="letter settled")
    # then: every event twice (at least once; consumers dedupe by event_id), the letter settled
    assert queue_depth(events) == 6
    letter.refresh_from_db()
    assert letter.resolution == dead_letters.SUCCEEDED_LATER


def test_a_health_sample_that_cannot_be_written_is_a_letter_the_next_sample_settles(
    clean, exclusive_workers, tmp_path: Path
) -> None:
    from cleanup.models import HealthSample
    from cleanup.tasks import sample_health_task

    HealthSample.objects.all().delete()
    with fleet.dedicated(tmp_path, WORKER):
        letter = letter_of_a_failing_run(sample_health_task, "INSERT", "cleanup_healthsample")
        assert letter.task_name == "cleanup.sample_health"
        assert HealthSample.objects.count() == 0
        # when: the next sample is written
        sample_health_task.apply_async()
        fleet.wait_until(lambda: not open_letters(), timeout=60, what="letter settled")
    assert HealthSample.objects.count() == 1
    letter.refresh_from_db()
    assert letter.resolution == dead_letters.SUCCEEDED_LATER


# --- a real broker outage under /readyz ------------------------------------------------------


class PrivateRedis:
    """A redis-server of the test's own on a free port (never the shared one), stopped and
    started again by the test."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = fleet.free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        self.directory.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [binary, *args, "--dir", str(self.directory)],
            stdout=(self.directory / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        fleet.wait_until(self.answers, timeout=20, what="private redis up")

    def answers(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def client_list(self) -> str:
        """CLIENT LIST of the server ("" when it does not answer)."""
        import redis

        try:
            client = redis.Redis.from_url(self.url, socket_timeout=5)
            return "\n".join(
                " ".join(f"{k}={v}" for k, v in c.items()) for c in client.client_list()
            )
        except redis.RedisError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.mark.django_db
def test_readyz_is_503_naming_the_broker_while_redis_is_down_and_recovers(
    client, settings, tmp_path: Path
) -> None:
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    try:
        settings.BROKER_IS_REDIS = True
        settings.CELERY_BROKER_URL = server.url
        settings.METRICS_TOKEN = "r" * 40
        client.defaults["HTTP_AUTHORIZATION"] = "Bearer " + "r" * 40
        assert client.get("/readyz").status_code == 200
        # when: the broker goes away
        server.stop()
        response = client.get("/readyz")
        # then: not ready, naming the broker; the database is fine
        body = response.json()
        assert response.status_code == 503
        assert body["checks"]["broker"]["ok"] is False
        assert body["checks"]["broker"]["error"].startswith("ConnectionError")
        assert body["checks"]["database"]["ok"] is True
        # when: it comes back on the same address, the next check is ready again
        server.start()
        assert client.get("/readyz").status_code == 200
    finally:
        server.stop()


# --- Redis dropping the connection during the screened transport's BRPOP ---------------------


def test_a_worker_whose_redis_dies_during_brpop_reconnects_and_releases(
    clean, exclusive_workers, tmp_path: Path
) -> None:
    from cleanup.conf import cleanup_settings
    from cleanup.wire import RELEASE_TASK
    from config.celery_app import app

    server = PrivateRedis(tmp_path / "redis")
    server.start()
    try:
        env = {**ENV, "CELERY_BROKER_URL": server.url}
        with fleet.dedicated(tmp_path, {"env": env, "settings": TUNED}) as (worker,):
            # given: the worker waiting in BRPOP on the private broker
            fleet.wait_until(
                lambda: "cmd=brpop" in server.client_list(), timeout=30, what="a BRPOP waiting"
            )
            # when: the server dies under it, and comes back on the same address
            server.stop()
            fleet.wait_until(
                lambda: fleet.log_lines([worker.log_path], "Connection to broker lost"),
                timeout=60,
                what="the worker noticing",
            )
            server.start()
            fleet.wait_until(
                lambda: "cmd=brpop" in server.client_list(), timeout=90, what="BRPOP again"
            )
            # then: a message published now is consumed and released
            hold_id, _ = fleet.one_eligible_hold()
            expires_at = fleet.scalar(
                "SELECT expires_at FROM reservations_reservation WHERE id = %s", [hold_id]
            )
            from cleanup.release.messages import build
            from tests.support.wire import send_signed

            message = build(hold_id, 1, expires_at, 0, "brpop-dropped")
            with app.connection_for_write(server.url) as conn:
                send_signed(
                    app,
                    RELEASE_TASK,
                    (message,),
                    queue=cleanup_settings().release_queue,
                    connection=conn,
                )
            fleet.wait_until(
                lambda: fleet.status_of(hold_id) == "released", timeout=60, what="released"
            )
            assert worker.alive()
    finally:
        server.stop()
    assert DeadLetter.objects.count() == 0
    assert fleet.outcome_counts() == {"released": 1}


# --- the beat failing to connect for its lease -----------------------------------------------


def test_a_beat_that_cannot_connect_for_its_lease_says_why_sends_nothing_and_recovers(
    clean, tmp_path: Path
) -> None:
    from cleanup.release.schedule import BEAT_LOCK_APP_PREFIX, install_schedule

    install_schedule(1, 1)
    database = connection.settings_dict["NAME"]

    def allow_connections(allowed: bool) -> None:
        # Said from another database: PostgreSQL refuses it for the current one.
        with psycopg.connect(
            psycopg.conninfo.make_conninfo(fleet.conninfo(), dbname="postgres"), autocommit=True
        ) as admin:
            admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS {allowed}')

    with fleet.beats(tmp_path, 1) as (beat,):
        fleet.wait_until(beat.is_leader, timeout=60, what="beat lock acquired")
        fleet.wait_until(lambda: beat.sends() >= 1, timeout=60, what="a send")
        try:
            # when: the lease session ends and no new connection is accepted
            allow_connections(False)
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name LIKE %s",
                    [BEAT_LOCK_APP_PREFIX + "%"],
                )
            fleet.wait_until(
                lambda: beat.lines("beat cannot take its lock"),
                timeout=60,
                what="the beat saying why it does not send",
            )
            sends_while_down = beat.sends()
            # then: it says so once, naming the cause, and keeps trying
            (said,) = beat.lines("beat cannot take its lock")
            assert "not currently accepting connections" in said
        finally:
            allow_connections(True)
        # when: the database takes connections again, the beat leads and sends again
        fleet.wait_until(
            lambda: len(beat.lines("beat lock acquired")) == 2, timeout=60, what="the lock again"
        )
        fleet.wait_until(lambda: beat.sends() > sends_while_down, timeout=60, what="sends again")
        assert beat.lines("beat reaches the database for its lock again")
        assert beat.lines("beat lock lost")
        assert beat.alive()


# --- requeue's publish failing: the broker down, then back ----------------------------------


def test_requeue_with_the_broker_down_keeps_the_letter_open_naming_the_error(
    clean, tmp_path: Path
) -> None:
    import sys

    hold_id, _ = fleet.one_eligible_hold()
    expires_at = fleet.scalar(
        "SELECT expires_at FROM reservations_reservation WHERE id = %s", [hold_id]
    )
    from cleanup.release.messages import build

    letter = dead_letters.record(
        DeadLetter.Reason.RETRIES_EXHAUSTED,
        error="gave up",
        task_name="cleanup.release_reservation",
        message=build(hold_id, 1, expires_at, 0, "requeue-down"),
    )
    assert letter is not None
    server = PrivateRedis(tmp_path / "redis")
    server.start()

    def requeue_command() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", "requeue_dead_letters", "--why", "broker drill"],
            cwd=fleet.ROOT,
            env=fleet.service_env(CELERY_BROKER_URL=server.url),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    try:
        server.stop()
        # when: the broker is down
        down = requeue_command()
        # then: exit 1, the letter open, and the error named where the operator reads it
        assert down.returncode == 1, down.stdout + down.stderr
        assert "failed 1" in down.stdout
        assert "those letters stay open. Error: OperationalError: " in down.stderr
        assert "Connection refused" in down.stderr or "connecting to" in down.stderr
        letter.refresh_from_db()
        assert letter.resolved_at is None
        # when: the broker is back, the same command sends it once
        server.start()
        up = requeue_command()
        assert up.returncode == 0, up.stdout + up.stderr
        assert "republished 1" in up.stdout
        import redis

        from cleanup.conf import cleanup_settings

        queue = cleanup_settings().release_queue
        assert redis.Redis.from_url(server.url).llen(queue) == 1
    finally:
        server.stop()
    letter.refresh_from_db()
    assert letter.resolution == "republished"


def test_a_prune_that_fails_deletes_nothing_and_its_letter_clears_once_a_prune_succeeds(
    clean, exclusive_workers, tmp_path: Path
) -> None:
    from cleanup.models import CleanupReceipt
    from cleanup.tasks import prune_task

    old = CleanupReceipt.objects.create(
        idempotency_key="release:1:1", reservation_id=1, version=1, outcome="released"
    )
    CleanupReceipt.objects.filter(pk=old.pk).update(created_at="2000-01-01T00:00:00Z")
    with fleet.dedicated(tmp_path, WORKER):
        with failing("DELETE", "cleanup_cleanupreceipt"):
            prune_task.apply_async()
            fleet.wait_until(open_letters, timeout=60, what="the prune's dead letter")
        (letter,) = open_letters()
        assert letter.reason == DeadLetter.Reason.PERIODIC_FAILED
        assert letter.task_name == "cleanup.prune"
        assert CleanupReceipt.objects.filter(pk=old.pk).exists()
        prune_task.apply_async()
        fleet.wait_until(lambda: not open_letters(), timeout=60, what="letter settled")
    assert not CleanupReceipt.objects.filter(pk=old.pk).exists()
    letter.refresh_from_db()
    assert letter.resolution == dead_letters.SUCCEEDED_LATER


@pytest.mark.parametrize(
    ("pool", "why"),
    [("threads", "enforces no task time limit"), ("solo", "enforces no task time limit")],
)
def test_a_worker_under_a_pool_without_time_limits_refuses_to_start(
    tmp_path: Path, pool: str, why: str
) -> None:
    """``celery worker --pool threads`` (a common tip for I/O-bound tasks) would run the
    pipeline without the time limits it is built on; the worker says so and exits instead."""
    # when: a real worker is started under that pool
    refused = fleet.Worker(f"{pool}-refused", 1, tmp_path / "refused.log", ["--pool", pool])
    refused.start()
    assert refused.proc is not None
    try:
        code = refused.proc.wait(timeout=90)
    finally:
        refused.kill()  # a worker that did start is not left behind
    # then: it exits non-zero before consuming anything, naming the pool, why and the setting
    out = (tmp_path / "refused.log").read_text()
    assert code != 0, out
    assert f"celery worker --pool {pool}: the {pool} pool {why}" in out
    assert "CLEANUP_WORKER_POOLS=prefork" in out
    # and: allowed by the setting (to measure it), the same pool starts
    allowed = {"extra_args": ["--pool", pool], "settings": {"CLEANUP_WORKER_POOLS": [pool]}}
    with fleet.dedicated(tmp_path, allowed) as (worker,):
        worker.wait_ready()
        assert worker.alive()
