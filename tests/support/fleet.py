"""Real ``celery worker`` processes for delivery-semantics tests, and SQL helpers.

Workers run the product's code unchanged, against the tests' own PostgreSQL database (the one
pytest-django created) and the tests' own Redis database number. Nothing here touches any other
database or Redis database.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

# The invariants moved to the product (the burst drill checks them too); re-exported here.
from cleanup.conf import cleanup_settings
from cleanup.release.messages import ReleaseMessage
from reservations.db import rows as sql
from reservations.db import scalar as scalar
from tests.support import ROOT as ROOT
from tests.support.child_python import settings_env
from tools.drills.invariants import invariant_violations as invariant_violations
from tools.drills.workers import CeleryProcess, WorkerProcess
from tools.seed import seed_holds


def test_database_url() -> str:
    """The tests' database as a ``DATABASE_URL``, straight to PostgreSQL."""
    db = settings.DATABASES["default"]
    user = db.get("USER") or ""
    password = db.get("PASSWORD") or ""
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = str(db.get("HOST") or "")
    port = db.get("PORT") or ""
    if host.startswith("/"):
        return f"postgres://{auth}/{db['NAME']}?host={host}" + (f"&port={port}" if port else "")
    return f"postgres://{auth}{host}{':' + str(port) if port else ''}/{db['NAME']}"


# host:port of a PgBouncer in transaction pooling in front of the tests' PostgreSQL
# (scripts/pgbouncer.py; scripts/test.sh's phase pytest-pgbouncer): when set, every child
# process reaches the tests' database through it, with DATABASE_POOLING=transaction and the
# direct URL as DATABASE_DIRECT_URL. The tests' own connections stay direct.
PGBOUNCER = os.environ.get("RESERVATIONS_TEST_PGBOUNCER", "")


def pooled_database_env(direct_url: str) -> dict[str, str]:
    """The database variables of a child process behind ``PGBOUNCER`` (none without it)."""
    if not PGBOUNCER:
        return {}
    db = settings.DATABASES["default"]
    user = db.get("USER") or ""
    password = db.get("PASSWORD") or ""
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    return {
        "DATABASE_URL": f"postgres://{auth}{PGBOUNCER}/{db['NAME']}",
        "DATABASE_DIRECT_URL": direct_url,
        "DATABASE_POOLING": "transaction",
    }


def service_env(
    django_settings: Mapping[str, object] | None = None, /, **overrides: str
) -> dict[str, str]:
    """Environment for a child process: test settings, the test database, the test broker;
    ``overrides`` as variables, ``django_settings`` as Django settings of the child's
    (``tests.child_settings``: the cleanup's tuning settings such as ``CLEANUP_RELEASE_MODE``,
    which are not environment variables)."""
    url = test_database_url()
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "config.settings.test",
            "DATABASE_URL": url,
            "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
            "PYTHONUNBUFFERED": "1",
            **pooled_database_env(url),
        }
    )
    env.update(settings_env(django_settings or {}))
    env.update(overrides)
    return env


class Worker(WorkerProcess):
    """A product worker (``tools.drills.workers``) on the tests' database and broker."""

    def __init__(
        self,
        name: str,
        concurrency: int,
        log_path: Path,
        extra_args: list[str] | None = None,
        env_overrides: dict[str, str] | None = None,
        django_settings: Mapping[str, object] | None = None,
    ) -> None:
        self.django_settings = dict(django_settings or {})
        super().__init__(
            name,
            concurrency,
            log_path,
            env=service_env(django_settings, **(env_overrides or {})),
            extra_args=list(extra_args or []),
        )


# Queues the tests use besides the product's (scenario 10 runs a capped fleet on its own).
EXTRA_QUEUES = ("sweep-cap", "cleanup-cap", "maintenance-cap", "scenario-5-lost")


def broker_is_redis() -> bool:
    return bool(settings.BROKER_IS_REDIS)


def broker_counts_redeliveries() -> bool:
    """Whether a redelivery is counted by the broker in the message (RabbitMQ's
    ``x-delivery-count`` from a quorum queue) instead of in the delivery counters."""
    return not broker_is_redis() and cleanup_settings().rabbitmq_queue_type == "quorum"


def test_queues() -> list[str]:
    return [
        cleanup_settings().sweep_queue,
        cleanup_settings().release_queue,
        cleanup_settings().maintenance_queue,
        *EXTRA_QUEUES,
    ]


def purge_broker() -> None:
    """Empty the tests' own broker space: on Redis the tests' own database number (its queues
    and kombu's unacked bookkeeping); on RabbitMQ the tests' queues in the tests' own vhost
    (messages a running worker holds unacked are not purgeable and come back to it)."""
    if broker_is_redis():
        from cleanup.broker.readers import redis_client

        redis_client().flushdb()
        return
    from config.celery_app import app

    with app.connection_for_write() as conn:
        for queue in test_queues():
            channel: Any = conn.channel()
            try:
                channel.queue_purge(queue)
            except Exception:  # noqa: BLE001 - not declared yet: nothing to purge
                pass
            finally:
                try:
                    channel.close()
                except Exception:  # noqa: BLE001
                    pass


def amqp_vhost() -> str:
    from urllib.parse import unquote, urlsplit

    path = urlsplit(settings.CELERY_BROKER_URL).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def unacked(queue: str) -> int | None:
    """Messages of ``queue`` delivered to a worker and not yet acknowledged. Redis: kombu's
    unacked hash. RabbitMQ: ``rabbitmqctl list_queues`` for the tests' vhost (AMQP itself does
    not report it); None when rabbitmqctl is not usable."""
    if broker_is_redis():
        from cleanup.broker.readers import unacked_count

        return unacked_count(queue)
    import shutil

    ctl = shutil.which("rabbitmqctl")
    if not ctl:
        return None
    out = subprocess.run(
        [ctl, "-q", "list_queues", "-p", amqp_vhost(), "name", "messages_unacknowledged"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == queue:
            return int(parts[1])
    return 0


@contextmanager
def rabbitmq_policy(name: str, queue: str, definition: dict[str, object]) -> Iterator[None]:
    """A RabbitMQ policy on ``queue`` of the tests' own vhost while the block runs (as an
    operator sets one with ``rabbitmqctl set_policy``), cleared afterwards."""
    import json
    import re
    import shutil

    ctl = shutil.which("rabbitmqctl")
    if not ctl:
        raise RuntimeError("rabbitmqctl is needed to set a policy on the tests' vhost")
    vhost = amqp_vhost()
    subprocess.run(
        [ctl, "-q", "set_policy", "-p", vhost, "--apply-to", "queues", name,
         f"^{re.escape(queue)}$", json.dumps(definition)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    try:
        yield
    finally:
        subprocess.run(
            [ctl, "-q", "clear_policy", "-p", vhost, name],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip


def queue_settled(queue: str) -> bool:
    """Nothing waiting in ``queue`` and nothing delivered and unacknowledged."""
    from cleanup.broker.readers import queue_depth

    return queue_depth(queue) == 0 and (unacked(queue) or 0) == 0


def delivery_totals(keys: list[str]) -> list[int]:
    """Delivery counters of many keys at once (the PostgreSQL table)."""
    counts = dict(
        sql(
            "SELECT idempotency_key, count FROM cleanup_deliverycount WHERE idempotency_key = "
            "ANY(%s)",
            [keys],
        )
    )
    return [int(counts.get(k, 0)) for k in keys]


def wait_until(
    predicate: Callable[[], Any], timeout: float = 60, interval: float = 0.25, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}: last={last!r}")


def conninfo() -> str:
    """The tests' database for a psycopg connection of the test's own."""
    return test_database_url().replace("postgres://", "postgresql://", 1)


@contextmanager
def offering_locked(offering_id: int) -> Iterator[psycopg.Connection[Any]]:
    """Hold the offering's row lock from a separate connection until the block ends."""
    conn = psycopg.connect(conninfo())
    try:
        conn.execute("SELECT id FROM reservations_offering WHERE id = %s FOR UPDATE", [offering_id])
        yield conn
    finally:
        conn.rollback()
        conn.close()


def blocked_backends() -> list[int]:
    """Backends of the test database waiting on a row lock (a release parked mid-transaction)."""
    rows = sql(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    )
    return [r[0] for r in rows]


def status_of(hold_id: int) -> str:
    return str(scalar("SELECT status FROM reservations_reservation WHERE id = %s", [hold_id]))


def create_eligible_holds(
    count: int, *, offerings: int = 4, expired_seconds_ago: int = 60, extra_capacity: int = 0
) -> list[int]:
    """Create ``count`` held reservations whose ``expires_at`` is already past, spread over
    ``offerings`` offerings, with seats accounted (capacity = holds + extra), in bulk SQL.

    Integration tests never move a clock: holds are created with a past expiry.
    """
    return seed_holds(
        count,
        offerings=offerings,
        expires_in=-float(expired_seconds_ago),
        extra_capacity=extra_capacity,
        name="burst",
    )


def one_eligible_hold() -> tuple[int, int]:
    """One eligible hold on an offering of its own: (hold id, offering id)."""
    hold_id = create_eligible_holds(1, offerings=1)[0]
    offering_id = scalar(
        "SELECT offering_id FROM reservations_reservation WHERE id = %s", [hold_id]
    )
    return hold_id, offering_id


def publish_for(hold_id: int) -> dict[str, Any]:
    """Publish the release message of a hold at version 1, as a sweep would."""
    from cleanup.release.publish import publish_release_messages

    expires_at = scalar("SELECT expires_at FROM reservations_reservation WHERE id = %s", [hold_id])
    message = ReleaseMessage.for_hold(hold_id, 1, expires_at, 0, f"trace-{uuid.uuid4().hex[:8]}")
    publish_release_messages([message])
    return message.as_dict()


def outcome_counts() -> dict[str, int]:
    return dict(sql("SELECT outcome, count(*) FROM cleanup_cleanupreceipt GROUP BY outcome"))


def released_count(ids: list[int]) -> int:
    return int(
        scalar(
            "SELECT count(*) FROM reservations_reservation "
            "WHERE id = ANY(%s) AND status = 'released'",
            [ids],
        )
    )


def run_sweeps(shards: int, expires: float | None = None) -> None:
    """Send one sweep per shard through the broker, as beat would (beat's entries carry
    ``expire_seconds`` = the interval, so a sweep that waited a whole interval is dropped)."""
    from cleanup.tasks import sweep_shard_task

    options: dict[str, Any] = {} if expires is None else {"expires": expires}
    for shard in range(shards):
        sweep_shard_task.apply_async(kwargs={"shard": shard, "shards": shards}, **options)


@contextmanager
def running(
    workers: list[Worker], *, kill: bool = False, grace: float = 20
) -> Iterator[list[Worker]]:
    """Start the workers and wait until each is ready; at the end stop them (SIGTERM, SIGKILL
    after ``grace`` seconds), or with ``kill`` SIGKILL them at once."""
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.wait_ready()
        yield workers
    finally:
        for w in workers:
            if kill:
                w.kill()
            else:
                w.stop(timeout=grace)


def fleet(
    tmp_dir: Path, count: int = 2, concurrency: int = 2, **kwargs: Any
) -> AbstractContextManager[list[Worker]]:
    return running(
        [
            Worker(f"itw{i}-{os.getpid()}", concurrency, tmp_dir / f"worker{i}.log", **kwargs)
            for i in range(count)
        ]
    )


def dedicated(tmp_path: Path, *specs: dict[str, Any]) -> AbstractContextManager[list[Worker]]:
    """One worker per spec (``concurrency``, default 1; ``extra_args``; ``env``; ``settings``,
    Django settings of its own), for one test: killed at the end."""
    return running(
        [
            Worker(
                f"dw{i}-{uuid.uuid4().hex[:6]}",
                spec.get("concurrency", 1),
                tmp_path / f"dedicated{i}.log",
                extra_args=spec.get("extra_args", []),
                env_overrides=spec.get("env", {}),
                django_settings=spec.get("settings", {}),
            )
            for i, spec in enumerate(specs)
        ],
        kill=True,
    )


def sweep_until(
    done: Callable[[], Any], *, shards: int, timeout: float = 120, every: float = 2.0
) -> None:
    """Send one sweep per shard every ``every`` seconds (as beat would) until ``done()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run_sweeps(shards, expires=every)
        step_end = time.monotonic() + every
        while time.monotonic() < step_end:
            if done():
                return
            time.sleep(0.25)
    raise TimeoutError(f"sweeps did not finish the work in {timeout}s")


def sweep_until_each_worker_swept(
    workers: list[Worker], *, shards: int, span: float, timeout: float = 60, every: float = 1.0
) -> None:
    """Send sweeps (as beat would) until each worker has finished sweeps, after this call,
    whose log stamps are at least ``span`` seconds apart: each worker's consumer went on
    fetching from the broker for that long, and the timers of its main process, which run in
    the same loop (the pause switch's poll, the restore scan), went on firing."""
    already = [len(log_lines([w.log_path], SWEEP_DONE)) for w in workers]

    def spanned() -> bool:
        for worker, skip in zip(workers, already, strict=True):
            stamps = [log_stamp(line) for line in log_lines([worker.log_path], SWEEP_DONE)[skip:]]
            if len(stamps) < 2 or stamps[-1] - stamps[0] < span:
                return False
        return True

    # A burst of one round per worker: Redis hands a message to the consumer that has waited
    # longest, and the worker that took the last one asks again at once, so single rounds a
    # second apart can all go to the same worker.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _ in workers:
            run_sweeps(shards, expires=every)
        step_end = time.monotonic() + every
        while time.monotonic() < step_end:
            if spanned():
                return
            time.sleep(0.25)
    raise TimeoutError(f"not every worker went on sweeping for {span}s within {timeout}s")


# --- Helpers for the scenario and beat tests (appended) ------------------------------------


def log_lines(paths: list[Path], needle: str) -> list[str]:
    """Lines of the given log files that contain ``needle``."""
    found: list[str] = []
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found.extend(line for line in text.splitlines() if needle in line)
    return found


SWEEP_DONE = "sweep done shard="
_LOG_STAMP = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)[.,](\d{3})")


def log_stamp(line: str) -> float:
    """The time a log line was written, in seconds, by the writer's clock (UTC or local: only
    differences between one process's lines mean anything)."""
    found = _LOG_STAMP.search(line)
    if found is None:
        raise ValueError(f"no time stamp in log line {line!r}")
    when = datetime.fromisoformat(f"{found[1]}T{found[2]}.{found[3]}")
    return when.replace(tzinfo=UTC).timestamp()


def log_fields(line: str) -> dict[str, str]:
    """``key=value`` pairs of one text-format log line (config.logging.KeyValueFormatter)."""
    fields: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key.isidentifier():
            fields[key] = value
    return fields


def hold_messages(
    ids: list[int], *, shard: int = 0, trace_id: str = "scenario"
) -> list[ReleaseMessage]:
    """Release messages for the holds as they are now (id, version, expires_at)."""

    rows = sql(
        "SELECT id, version, expires_at FROM reservations_reservation WHERE id = ANY(%s) "
        "ORDER BY id",
        [ids],
    )
    return [
        ReleaseMessage.for_hold(rid, version, expires_at, shard, trace_id)
        for rid, version, expires_at in rows
    ]


def released_times(ids: list[int]) -> list[float]:
    """When each of the released holds among ``ids`` was released (epoch seconds, in order)."""
    return [
        float(t)
        for (t,) in sql(
            "SELECT extract(epoch FROM released_at) FROM reservations_reservation "
            "WHERE id = ANY(%s) AND status = 'released' ORDER BY released_at",
            [ids],
        )
    ]


def outcomes_logged(logs: list[Path]) -> Counter[str]:
    """Release attempts the workers logged, by outcome (one line per batch of holds)."""
    found: Counter[str] = Counter()
    for line in log_lines(logs, "release attempt reservation_id="):
        found[log_fields(line)["outcome"]] += 1
    for line in log_lines(logs, "release batch attempt"):
        found.update(ast.literal_eval(line.partition("outcomes=")[2].partition("} ")[0] + "}"))
    return found


def delivery_counts(keys: list[str]) -> list[int]:
    """The delivery counter of each idempotency key (cleanup.release.delivery_cap), in order."""
    from cleanup.release import delivery_cap

    return [delivery_cap.current(key) for key in keys]


def claim_counts(ids: list[int]) -> dict[int, int]:
    return dict(
        sql("SELECT id, claim_count FROM reservations_reservation WHERE id = ANY(%s)", [ids])
    )


def send_installed_sweeps() -> int:
    """Send one sweep per *enabled* sweep entry of the installed beat schedule, with the
    entry's own kwargs and queue, as beat would. Returns how many were sent."""
    import json

    from django_celery_beat.models import PeriodicTask

    from cleanup.release.schedule import SWEEP_PREFIX
    from cleanup.tasks import sweep_shard_task

    sent = 0
    for entry in PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX, enabled=True):
        sweep_shard_task.apply_async(kwargs=json.loads(entry.kwargs), queue=entry.queue)
        sent += 1
    return sent


@dataclass
class Beat(CeleryProcess):
    """A real ``celery beat`` process with the product's scheduler (LeaderDatabaseScheduler)."""

    name: str
    log_path: Path
    env_overrides: dict[str, str] = field(default_factory=dict)
    django_settings: dict[str, object] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def celery_args(self) -> list[str]:
        return [
            "beat",
            "--loglevel",
            "INFO",
            "--pidfile",
            str(self.log_path.with_suffix(".pid")),
            "--schedule",
            str(self.log_path.with_suffix(".schedule")),
        ]

    def environment(self) -> dict[str, str]:
        return service_env(self.django_settings, **self.env_overrides)

    def lines(self, needle: str) -> list[str]:
        return log_lines([self.log_path], needle)

    def is_leader(self) -> bool:
        return bool(self.lines("beat lock acquired"))

    def lock_pinged_at(self) -> datetime | None:
        """When this beat's lease session last ran a statement, by PostgreSQL's clock
        (``pg_stat_activity.query_start``): a leading beat pings it at every tick, before it
        sends what is due."""
        from cleanup.release.schedule import BEAT_LOCK_APP_PREFIX

        pinged: datetime | None = scalar(
            "SELECT max(query_start) FROM pg_stat_activity WHERE application_name LIKE %s",
            [f"{BEAT_LOCK_APP_PREFIX}%:{self.pid}"],
        )
        return pinged

    def sends(self, entry_prefix: str = "cleanup: sweep shard ") -> int:
        """Sends logged so far ("Scheduler: Sending due task <name> (...)")."""
        return len(self.lines(f"Sending due task {entry_prefix}"))

    def stop(self, timeout: float = 15) -> None:
        super().stop(timeout)


@contextmanager
def drill_workers(
    tmp_dir: Path,
    prefix: str,
    env: dict[str, str],
    count: int = 2,
    concurrency: int = 2,
    django_settings: Mapping[str, object] | None = None,
) -> Iterator[list[Worker]]:
    """``count`` workers of a drill's own (logs ``tmp_dir/worker<i>.log``), started and ready;
    stopped when the block ends, each given 30 s to finish its task."""
    workers = [
        Worker(
            f"{prefix}{i}-{uuid.uuid4().hex[:6]}",
            concurrency,
            tmp_dir / f"worker{i}.log",
            env_overrides=env,
            django_settings=django_settings,
        )
        for i in range(count)
    ]
    with running(workers, grace=30) as started:
        yield started


def assert_each_released_once(ids: list[int]) -> None:
    """A drill's end: every hold of ``ids`` released exactly once, seats conserved, none left
    held."""
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts().get("released") == len(ids)
    assert (
        scalar(
            "SELECT count(*) FROM reservations_reservation WHERE id = ANY(%s) AND status = 'held'",
            [ids],
        )
        == 0
    )


@contextmanager
def beats(tmp_dir: Path, count: int = 1, **kwargs: Any) -> Iterator[list[Beat]]:
    """``count`` beat processes, stopped (SIGTERM, then SIGKILL) on exit."""
    started = [
        Beat(f"beat{i}", tmp_dir / f"beat{i}-{os.getpid()}.log", **kwargs).start()
        for i in range(count)
    ]
    try:
        yield started
    finally:
        for b in started:
            b.stop()


# -- worker metrics, scraped as Prometheus would

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape_worker(port: int) -> tuple[Samples, float]:
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    return parse(body), time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def total(m: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= set(ls))


class SessionFleet:
    """Two worker instances of concurrency 2 on the standard queues, started on first use and
    shared by the session's tests. Tests that run their own workers on the same queues pause it
    first (``exclusive_workers``), so no other consumer takes their messages; every unit test
    pauses it too (tests/unit/conftest.py), since unit tests read back the queue entries they
    wrote."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.workers: list[Worker] = []
        self.generation = 0

    def ensure(self) -> list[Worker]:
        if self.workers and all(w.alive() for w in self.workers):
            return self.workers
        self.pause()
        self.generation += 1
        self.workers = [
            Worker(f"itw{i}-g{self.generation}-{os.getpid()}", 2, self.logs / f"worker{i}.log")
            for i in range(2)
        ]
        for w in self.workers:
            w.start()
        for w in self.workers:
            w.wait_ready()
        return self.workers

    def pause(self) -> None:
        for w in self.workers:
            w.stop(timeout=20)
        self.workers = []
