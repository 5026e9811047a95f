"""The cleanup's settings, as one typed object.

Each field of ``CleanupSettings`` names its Django setting, its type, its default, its lower
bound and a one-line doc; the checks that relate fields to each other live in
``CleanupSettings.check``. A field declared with ``setting`` is a decision a deployment makes and
is read from the environment variable of the same name; one declared with ``tuning`` is an
internal value or a benchmark's arm, a Django setting only: a deployment leaves it at its
default, a test overrides it like any setting. Django's settings stay the source a deployer sets
and a test overrides: ``config/settings/base.py`` builds the object with
``CleanupSettings.from_environment`` (start-up fails naming the variable) and publishes every
field under its name, and the code reads ``cleanup_settings()``, built from
``django.conf.settings`` and rebuilt whenever ``override_settings`` (or pytest-django's
``settings`` fixture) changes a setting. docs/ARCHITECTURE.md, "Settings".
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from cleanup.wire import TASK_PREFIX

# The keys of a field's metadata (what tests/unit/cleanup/test_conf.py checks
# docs/CONFIGURATION.md's settings tables against). ENV is the field's name among Django's settings,
# and its environment variable's when ENVIRONMENT is true.
ENV = "env"
DOC = "doc"
MINIMUM = "minimum"
DEFAULT_TEXT = "default_text"
ENVIRONMENT = "environment"

RELEASE_MODES = ("adaptive", "single", "batch")
# RabbitMQ's queue types the project declares (cleanup.broker.queues) and the broker's fixed
# delivery limit on a quorum queue, which the project's own cap must stay below.
RABBITMQ_QUEUE_TYPES = ("classic", "quorum")
QUORUM_DELIVERY_LIMIT = 100
# The pools of `celery worker --pool` (celery.concurrency.ALIASES less "custom", "processes").
WORKER_POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")
# Redis keys kombu keeps its ack emulation and bindings in: never a queue's name.
RESERVED_REDIS_KEYS = frozenset({"unacked", "unacked_index", "unacked_mutex"})
RESERVED_REDIS_PREFIXES = ("_kombu.", "reservation-cleanup:")
# The shortest retention of receipts, events and resolved dead letters: 0.001 days, 86.4 s.
MIN_RETENTION_DAYS = 0.001
MAX_RELEASE_BATCH_SIZE = 1000  # items a worker accepts in one message (pipeline.messages)
DEFAULT_REMOTE_CONTROL_COMMANDS = (
    "ping",
    "stats",
    "active",
    "reserved",
    "scheduled",
    "revoked",
    "registered",
    "active_queues",
    "query_task",
    "clock",
    "enable_events",
)
# CLEANUP_REMOTE_CONTROL_COMMANDS=none: no remote control at all (Celery's consumer of the
# broadcast channel is not started).
NO_REMOTE_CONTROL = "none"
# Rows deleted per prune or summarise statement: short enough that a statement holds its locks
# for well under a second, large enough that the hourly prune of a day's receipts is a few
# hundred statements.
PRUNE_BATCH_SIZE = 5000
# Seconds per release of one pool process that the autoscaler and the adaptive release mode
# assume until receipts have measured one, unless CLEANUP_CAPACITY_PER_CONSUMER_PER_S states it:
# a release is one statement of a few milliseconds plus Celery's per-message cost, about 50 ms
# on the 2-core machine of docs/PERFORMANCE.md (20 releases per second per process).
ASSUMED_SERVICE_TIME_S = 0.05


def setting(
    env: str,
    default: object,
    doc: str,
    *,
    minimum: float | None = None,
    default_text: str | None = None,
    secret: bool = False,
) -> Any:
    """A field of ``CleanupSettings``; ``default_text`` is how the settings table
    (docs/CONFIGURATION.md) states a default that the project computes (the broker's URL, half
    the soft time limit). A ``secret`` (a token, a URL that may carry a password) is left out of
    the object's repr, which may reach a log."""
    metadata = {
        ENV: env,
        DOC: doc,
        MINIMUM: minimum,
        DEFAULT_TEXT: default_text,
        ENVIRONMENT: True,
    }
    return field(default=default, metadata=metadata, repr=not secret)


def tuning(
    name: str,
    default: object,
    doc: str,
    *,
    minimum: float | None = None,
    default_text: str | None = None,
) -> Any:
    """A field that is a Django setting only, never read from the environment: an internal
    value (a lock key, a poll interval, a cost cap) or a benchmark's arm (the release mode, the
    worker pools). A deployment leaves it at its default; a test overrides it like any setting,
    and a settings module built on ``config.settings.base`` may set it before importing it
    (``config.settings.tuning``). Bounds and checks apply as to any field."""
    metadata = {
        ENV: name,
        DOC: doc,
        MINIMUM: minimum,
        DEFAULT_TEXT: default_text,
        ENVIRONMENT: False,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CleanupSettings:
    # --- queues and messages ---------------------------------------------------------------
    sweep_queue: str = tuning("CLEANUP_SWEEP_QUEUE", "sweep", "queue of beat's sweep messages")
    release_queue: str = tuning(
        "CLEANUP_RELEASE_QUEUE", "cleanup", "queue of the release messages (Celery's default)"
    )
    maintenance_queue: str = tuning(
        "CLEANUP_MAINTENANCE_QUEUE", "maintenance", "queue of relay, prune and health samples"
    )
    events_queue: str = setting(
        "CLEANUP_EVENTS_QUEUE", "reservation-events", "queue the outbox events are relayed to"
    )
    # Other tasks of the apps' app (a host's, a benchmark's), each on a queue of its own that is
    # declared and routed as the project's are, so the routing refusal (cleanup.broker.routes)
    # accepts that queue, and runs each such task only from it.
    extra_task_routes: tuple[str, ...] = tuning(
        "CLEANUP_EXTRA_TASK_ROUTES",
        (),
        "'task=queue' pairs: other tasks of the apps' app, each routed to a queue of its own",
    )
    # Quorum queues are replicated over a RabbitMQ cluster's nodes (docs/TOPOLOGIES.md,
    # "RabbitMQ cluster"); RabbitMQ refuses to change the type of a queue that exists.
    rabbitmq_queue_type: str = setting(
        "CLEANUP_RABBITMQ_QUEUE_TYPE",
        "classic",
        "'classic' or 'quorum': the type of the RabbitMQ queues the project declares",
    )
    # A batch of 1,000 holds is about 170 KB. docs/HARDENING.md.
    max_message_bytes: int = tuning(
        "CLEANUP_MAX_MESSAGE_BYTES",
        1024 * 1024,
        "largest message body a worker reads; larger ones are dead-lettered unread",
        minimum=64 * 1024,
    )
    # --- time limits, retries, deliveries --------------------------------------------------
    # Time limits bound a stuck release; the soft limit leaves room to roll back and log. A
    # release is one statement (milliseconds) and a sweep stops at its time budget, so 30 s is
    # generous; it is kept short because the visibility timeout must cover it, and that timeout
    # is how long a lost node's messages wait before coming back.
    task_time_limit: int = setting(
        "CLEANUP_TASK_TIME_LIMIT", 30, "hard time limit of every task, seconds", minimum=1
    )
    task_soft_time_limit: int = setting(
        "CLEANUP_TASK_SOFT_TIME_LIMIT", 25, "soft time limit, seconds (below the hard)", minimum=1
    )
    # Retries: exponential backoff with full jitter, capped well below the visibility timeout.
    max_retries: int = setting(
        "CLEANUP_MAX_RETRIES", 5, "retries of a transient error before dead-lettering", minimum=0
    )
    retry_backoff_max: int = setting(
        "CLEANUP_RETRY_BACKOFF_MAX", 30, "cap of the jittered retry backoff, seconds", minimum=1
    )
    # Bounds a poison message that kills its worker (reject_on_worker_lost requeues it without
    # limit).
    max_deliveries: int = tuning(
        "CLEANUP_MAX_DELIVERIES",
        8,
        "deliveries of one idempotency key before it is dead-lettered unworked",
        minimum=1,
    )
    counter_redis_url: str = setting(
        "CLEANUP_COUNTER_REDIS_URL",
        "",
        "Redis of the per-minute attempt tally; empty: no tally (delivery counts: PostgreSQL)",
        default_text="the broker, if Redis",
        secret=True,
    )
    # --- sweeps ----------------------------------------------------------------------------
    # A claim leases a hold for lease_seconds; after it a later sweep takes the hold again.
    lease_seconds: int = setting(
        "CLEANUP_LEASE_SECONDS",
        300,
        "a claimed hold is retaken by a later sweep after this",
        minimum=1,
    )
    sweep_batch_size: int = tuning(
        "CLEANUP_SWEEP_BATCH_SIZE", 500, "holds claimed per sweep batch", minimum=1
    )
    sweep_max_batches: int = tuning("CLEANUP_SWEEP_MAX_BATCHES", 20, "batches per sweep", minimum=1)
    max_claims: int = tuning(
        "CLEANUP_MAX_CLAIMS", 10, "claims of one hold before it is set aside", minimum=1
    )
    sweep_time_budget: float = tuning(
        "CLEANUP_SWEEP_TIME_BUDGET",
        0.0,
        "a sweep starts no batch after this many seconds; 0: half the soft time limit",
        minimum=0,
        default_text="half the soft time limit",
    )
    max_queue_depth: int = setting(
        "CLEANUP_MAX_QUEUE_DEPTH",
        20000,
        "backpressure: sweeps stop publishing above this release-queue depth",
        minimum=1,
    )
    # docs/PIPELINE.md, "Release modes".
    release_mode: str = tuning(
        "CLEANUP_RELEASE_MODE",
        "adaptive",
        "'adaptive': a message per hold unless a burst would make the oldest hold later than "
        "the target; 'single': always a message per hold; 'batch': always per batch",
    )
    # As many as a sweep claims at once (CLEANUP_SWEEP_BATCH_SIZE's default): a full claimed
    # batch is one message. A batched drain's cost is mostly per message (Celery's fetch,
    # acknowledgment and trace, the sweep's publish): 500 per message drained 1.4-1.6x as fast
    # as 100 on the same machine (docs/PERFORMANCE.md, "The batched path").
    release_batch_size: int = tuning(
        "CLEANUP_RELEASE_BATCH_SIZE",
        500,
        "holds per message in the batch mode, the most in the adaptive mode (at most 1,000)",
        minimum=1,
    )
    release_target_seconds: float = tuning(
        "CLEANUP_RELEASE_TARGET_SECONDS",
        10.0,
        "adaptive mode: the age a claimed batch's oldest hold should not pass before its "
        "message is started, seconds",
        minimum=0.1,
    )
    # A sweep waiting in line for the publish lock holds a pool process that could be releasing.
    sweep_lock_wait: float = tuning(
        "CLEANUP_SWEEP_LOCK_WAIT",
        2.0,
        "how long a sweep waits in line for the publish lock (never past its time budget), seconds",
        minimum=0.05,
    )
    # --- retention and relay ---------------------------------------------------------------
    # Days, fractions allowed: at a thousand releases a second a day of receipts is 86 million
    # rows, and a deployment that busy keeps hours (0.25 is six hours); a soak shows the prune
    # in minutes. At least the lease and the visibility timeout (check): a message redelivered
    # or re-published that late still finds its receipt.
    retention_days: float = setting(
        "CLEANUP_RETENTION_DAYS",
        14.0,
        "days receipts and outbox events (relayed or not) are kept (fractions allowed)",
        minimum=MIN_RETENTION_DAYS,
    )
    # Bounds what events nobody consumes can pile up on the broker: at this depth the relay
    # leaves the events in the outbox (docs/EVENTS.md, "What happens to events nobody reads").
    events_queue_max_length: int = tuning(
        "CLEANUP_EVENTS_QUEUE_MAX_LENGTH",
        100000,
        "the outbox relay relays nothing while the events queue holds this many messages",
        minimum=1,
    )
    dead_letter_retention_days: float = setting(
        "CLEANUP_DEAD_LETTER_RETENTION_DAYS",
        14.0,
        "days a resolved dead letter is kept after it was resolved (fractions allowed)",
        minimum=MIN_RETENTION_DAYS,
    )
    # The summaries: one open letter per reason and task, written by cleanup.sample_health.
    # docs/OPERATOR-CONSOLE.md, "Dead-letter triage".
    dead_letter_open_cap: int = tuning(
        "CLEANUP_DEAD_LETTER_OPEN_CAP",
        10000,
        "open dead letters kept in full; the oldest beyond it are summarised",
        minimum=1,
    )
    # --- the operator's view and beat ------------------------------------------------------
    slo_seconds: int = setting(
        "CLEANUP_SLO_SECONDS", 300, "SLO for the age of the oldest eligible hold", minimum=1
    )
    # Counting eligible holds costs a row per hold: the cap bounds what a gauge or the health
    # page pays in a large backlog, which is already past any SLO long before.
    eligible_count_cap: int = tuning(
        "CLEANUP_ELIGIBLE_COUNT_CAP", 100000, "eligible holds counted at most", minimum=1
    )
    # The second key of the beat lock's advisory lock (first: cleanup.release.locks.NAMESPACE):
    # above the per-shard sweep keys (shards × 4096 + shard + 1) of any schedule of fewer than
    # 170 shards. A test takes one of its own so that no other beat holds its lock.
    beat_lock_id: int = tuning(
        "CLEANUP_BEAT_LOCK_ID", 727_001, "PostgreSQL advisory lock key of the beat lock"
    )
    beat_idle_session_timeout: int = tuning(
        "CLEANUP_BEAT_IDLE_SESSION_TIMEOUT",
        30,
        "seconds after which a silent beat leader's session (and lock) ends",
        minimum=1,
    )
    # A staff user can give a periodic task any interval in django-celery-beat's admin, down to
    # microseconds; a task sent that often floods its queue (the admin refuses it, beat skips it).
    periodic_min_interval: float = tuning(
        "CLEANUP_PERIODIC_MIN_INTERVAL",
        1.0,
        "shortest interval in seconds of any periodic task (admin form and beat)",
        minimum=0.001,
    )
    # Beat's sends, whatever its rows say (cleanup.release.schedule.SendBucket): a schedule that
    # asks for more is sent at this rate, the excess deferred and counted, never dropped. Above
    # what the Cleanup schedule needs (shards / interval, plus three maintenance entries).
    beat_max_sends_per_second: int = tuning(
        "CLEANUP_BEAT_MAX_SENDS_PER_SECOND",
        100,
        "most messages beat sends in one second; the excess waits its turn",
        minimum=1,
    )
    # --- Redis redelivery ------------------------------------------------------------------
    # A message fetched but not acked comes back after the visibility timeout, also when its
    # worker is lost, so recovery after a node loss is about this + the restore interval
    # (default 75 + 5 s, measured about 80 s). The clock starts when the worker fetches the
    # message, so it must exceed the longest a fetched message can stay unacked without
    # anything being wrong: a retry is an ETA message held unacked in the worker for up to the
    # backoff cap and then run for up to the hard time limit; longer, and a running or waiting
    # task is delivered twice (docs/PIPELINE.md "Recovery times", docs/LIBRARY-NOTES.md §2).
    # kombu's default restore scan runs about every 100 s; one every few seconds bounds a dead
    # worker's recovery at visibility timeout + this interval.
    visibility_timeout: int = setting(
        "CLEANUP_VISIBILITY_TIMEOUT",
        75,
        "seconds a fetched, unacked Redis message waits before it is delivered again",
        minimum=1,
    )
    unacked_restore_interval: int = tuning(
        "CLEANUP_UNACKED_RESTORE_INTERVAL",
        5,
        "seconds between an idle consumer's scans for messages past the visibility timeout",
        minimum=1,
    )
    # The default is what `manage.py worker_health`, `celery inspect` and Flower's read-only
    # pages use; add e.g. pool_grow or shutdown only with a broker you trust. docs/HARDENING.md.
    # "none" turns remote control off (the field is then empty).
    remote_control_commands: tuple[str, ...] = setting(
        "CLEANUP_REMOTE_CONTROL_COMMANDS",
        DEFAULT_REMOTE_CONTROL_COMMANDS,
        "remote-control commands a worker runs; any other is dropped and counted; 'none': off",
    )
    # A cleanup worker relies on both task time limits and on losing one pool process at a time
    # (docs/LIBRARY-NOTES.md, "Pools"); only prefork gives both. cleanup.worker.consumer.
    worker_pools: tuple[str, ...] = tuning(
        "CLEANUP_WORKER_POOLS",
        ("prefork",),
        "worker pools (`celery worker --pool`) a worker may start under; any other fails its "
        "start, saying why (add one only to measure it)",
    )
    # --- metrics ---------------------------------------------------------------------------
    metrics_token: str = setting("METRICS_TOKEN", "", "bearer token of /metrics", secret=True)
    metrics_allow_ips: tuple[str, ...] = setting(
        "METRICS_ALLOW_IPS", (), "addresses and networks that may read /metrics without it"
    )
    # One scrape of the fleet reads the eligible backlog per interval; every other scrape, of
    # any web process, exports that reading (cleanup.operations.console.backlog_reading).
    eligible_reading_seconds: float = tuning(
        "CLEANUP_ELIGIBLE_READING_SECONDS",
        5.0,
        "seconds one reading of the eligible backlog serves every scrape; 0: each scrape reads",
        minimum=0,
    )
    metrics_statement_timeout_ms: int = tuning(
        "METRICS_STATEMENT_TIMEOUT_MS", 2000, "statement timeout of /metrics' queries", minimum=1
    )
    # The worker metrics endpoint has no authentication: loopback unless a deployment binds it
    # to the private network its Prometheus scrapes from (compose does).
    worker_metrics_port: int = setting(
        "WORKER_METRICS_PORT", 0, "port of a worker's own metrics endpoint; 0: none", minimum=0
    )
    worker_metrics_addr: str = setting(
        "WORKER_METRICS_ADDR", "127.0.0.1", "address that endpoint binds (it has no auth)"
    )
    worker_metrics_compact_interval: float = tuning(
        "WORKER_METRICS_COMPACT_INTERVAL",
        30.0,
        "seconds between folds of dead pool children's metric files",
        minimum=0.1,
    )
    # --- capacity and the pool autoscaler --------------------------------------------------
    # Inputs of cleanup.operations.scaling.capacity.desired_consumers (the desired_consumers
    # gauge, the autoscaler); the autoscaler is cleanup.operations.scaling.autoscale (`celery
    # worker --autoscale`). CLEANUP_CAPACITY_PER_CONSUMER_PER_S, when set, is the service time
    # both use (its inverse); otherwise the receipts' measured one, else ASSUMED_SERVICE_TIME_S.
    capacity_peak_arrivals_per_s: float = setting(
        "CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S",
        0.0,
        "planned peak arrival rate, a floor under the measured one",
        minimum=0,
    )
    capacity_per_consumer_per_s: float = setting(
        "CLEANUP_CAPACITY_PER_CONSUMER_PER_S",
        0.0,
        "measured releases per second of one consumer; 0: the receipts' mean duration",
        minimum=0,
    )
    capacity_headroom: float = tuning(
        "CLEANUP_CAPACITY_HEADROOM", 0.5, "retry headroom on the arrival rate", minimum=0
    )
    autoscale_interval: float = tuning(
        "CLEANUP_AUTOSCALE_INTERVAL", 5.0, "seconds between autoscaler decisions", minimum=0.2
    )
    autoscale_window: float = tuning(
        "CLEANUP_AUTOSCALE_WINDOW",
        60.0,
        "seconds the autoscaler's rates are measured over",
        minimum=1,
    )
    autoscale_slo_target: float = tuning(
        "CLEANUP_AUTOSCALE_SLO_TARGET",
        0.5,
        "fraction of the SLO the oldest hold may reach before the backlog must be drained",
        minimum=0.01,
    )
    autoscale_utilization: float = tuning(
        "CLEANUP_AUTOSCALE_UTILIZATION", 0.7, "utilization the pool is sized for", minimum=0.01
    )
    autoscale_cooldown: float = setting(
        "CLEANUP_AUTOSCALE_COOLDOWN",
        60.0,
        "seconds a lower target must persist before the pool shrinks",
        minimum=0,
    )
    autoscale_statement_timeout_ms: int = tuning(
        "CLEANUP_AUTOSCALE_STATEMENT_TIMEOUT_MS",
        2000,
        "statement timeout of the autoscaler's queries",
        minimum=1,
    )

    def __post_init__(self) -> None:
        if tuple(self.remote_control_commands) == (NO_REMOTE_CONTROL,):
            object.__setattr__(self, "remote_control_commands", ())
        self.check()
        if not self.sweep_time_budget:
            # Half the soft limit: waiting for the publish lock or a slow broker never runs a
            # sweep into its time limit.
            object.__setattr__(self, "sweep_time_budget", self.task_soft_time_limit / 2)

    def extra_routes(self) -> dict[str, str]:
        """``CLEANUP_EXTRA_TASK_ROUTES`` as ``{task name: queue}`` (checked by ``check``)."""
        return dict(pair.partition("=")[::2] for pair in self.extra_task_routes)

    def _check_extra_routes(self) -> None:
        own = {self.sweep_queue, self.release_queue, self.maintenance_queue, self.events_queue}
        for pair in self.extra_task_routes:
            name, equals, queue = pair.partition("=")
            problem = None
            if not equals or not name or not queue or pair != pair.strip():
                problem = "expected 'task=queue'"
            elif name.startswith(TASK_PREFIX):
                problem = f"tasks named {TASK_PREFIX}* are the project's, routed by cleanup.wire"
            elif queue in own:
                problem = "the queue is one of the project's own"
            elif queue in RESERVED_REDIS_KEYS or queue.startswith(RESERVED_REDIS_PREFIXES):
                problem = "the queue's name is a key kombu keeps its own bookkeeping in"
            elif any(c.isspace() or c in "*#" for c in queue):
                problem = "a queue name has no space, * or #"
            if problem is not None:
                raise ImproperlyConfigured(f"CLEANUP_EXTRA_TASK_ROUTES: {pair[:120]!r}: {problem}")
        names = [pair.partition("=")[0] for pair in self.extra_task_routes]
        if len(set(names)) != len(names):
            raise ImproperlyConfigured("CLEANUP_EXTRA_TASK_ROUTES names a task twice")

    def check(self) -> None:
        """Each bound, then the rules between fields; the message names the variables."""
        for spec in dataclasses.fields(self):
            minimum = spec.metadata[MINIMUM]
            value = getattr(self, spec.name)
            if minimum is not None and value < minimum:
                raise ImproperlyConfigured(f"{spec.metadata[ENV]}={value} must be >= {minimum}")
        self._check_extra_routes()
        if self.release_mode not in RELEASE_MODES:
            raise ImproperlyConfigured(
                f"CLEANUP_RELEASE_MODE={self.release_mode!r}: expected one of "
                f"{', '.join(repr(mode) for mode in RELEASE_MODES)}"
            )
        if self.rabbitmq_queue_type not in RABBITMQ_QUEUE_TYPES:
            raise ImproperlyConfigured(
                f"CLEANUP_RABBITMQ_QUEUE_TYPE={self.rabbitmq_queue_type!r}: expected one of "
                f"{', '.join(repr(kind) for kind in RABBITMQ_QUEUE_TYPES)}"
            )
        if self.rabbitmq_queue_type == "quorum" and self.max_deliveries >= QUORUM_DELIVERY_LIMIT:
            # The broker's limit is a backstop: the project's cap, which writes the dead letter
            # with its reason, must act first.
            raise ImproperlyConfigured(
                f"CLEANUP_MAX_DELIVERIES={self.max_deliveries} must be below the quorum "
                f"queues' x-delivery-limit ({QUORUM_DELIVERY_LIMIT}) with "
                f"CLEANUP_RABBITMQ_QUEUE_TYPE=quorum"
            )
        if NO_REMOTE_CONTROL in self.remote_control_commands:
            raise ImproperlyConfigured(
                f"CLEANUP_REMOTE_CONTROL_COMMANDS: {NO_REMOTE_CONTROL!r} turns remote control "
                "off and stands alone, not among other commands"
            )
        unknown_pools = sorted(set(self.worker_pools) - set(WORKER_POOLS))
        if unknown_pools:
            raise ImproperlyConfigured(
                f"CLEANUP_WORKER_POOLS names {', '.join(map(repr, unknown_pools))}: expected "
                f"among {', '.join(WORKER_POOLS)}"
            )
        if self.release_batch_size > MAX_RELEASE_BATCH_SIZE:
            raise ImproperlyConfigured(
                f"CLEANUP_RELEASE_BATCH_SIZE={self.release_batch_size} must be <= "
                f"{MAX_RELEASE_BATCH_SIZE}"
            )
        longest_hold = self.task_time_limit + self.retry_backoff_max
        if self.visibility_timeout <= longest_hold:
            raise ImproperlyConfigured(
                f"CLEANUP_VISIBILITY_TIMEOUT={self.visibility_timeout} must exceed "
                f"CLEANUP_TASK_TIME_LIMIT + CLEANUP_RETRY_BACKOFF_MAX ({longest_hold}): a retry "
                f"waits unacked for up to the backoff cap, then runs for up to the time limit"
            )
        kept_s = self.retention_days * 86400
        if kept_s <= max(self.lease_seconds, self.visibility_timeout):
            raise ImproperlyConfigured(
                f"CLEANUP_RETENTION_DAYS={self.retention_days:g} ({kept_s:g} s) must exceed "
                f"CLEANUP_LEASE_SECONDS and CLEANUP_VISIBILITY_TIMEOUT: a message redelivered "
                f"or re-published that late must still find its receipt"
            )
        if self.max_deliveries <= self.max_retries:
            # Each Celery retry is a delivery too; a cap below the retries would dead-letter a
            # message that is merely retrying a transient error.
            raise ImproperlyConfigured(
                f"CLEANUP_MAX_DELIVERIES={self.max_deliveries} must exceed "
                f"CLEANUP_MAX_RETRIES={self.max_retries}"
            )
        if self.task_soft_time_limit >= self.task_time_limit:
            raise ImproperlyConfigured(
                "CLEANUP_TASK_SOFT_TIME_LIMIT must be below CLEANUP_TASK_TIME_LIMIT"
            )
        if self.autoscale_slo_target > 1 or self.autoscale_utilization > 1:
            raise ImproperlyConfigured(
                "CLEANUP_AUTOSCALE_SLO_TARGET and CLEANUP_AUTOSCALE_UTILIZATION must be <= 1"
            )

    @classmethod
    def specs(cls) -> list[tuple[dataclasses.Field[Any], type]]:
        """(field, type) of every setting; the type is ``str``, ``int``, ``float`` or
        ``tuple`` (a tuple of strings)."""
        hints = typing.get_type_hints(cls)
        return [
            (spec, typing.get_origin(hints[spec.name]) or hints[spec.name])
            for spec in dataclasses.fields(cls)
        ]

    @classmethod
    def from_environment(
        cls,
        read: Callable[[str, type, object], object],
        defaults: Mapping[str, object] | None = None,
    ) -> CleanupSettings:
        """Every ``setting`` read by ``read(variable, type, default)``
        (``config.env.env_typed``, which names the variable of a value it cannot parse), every
        ``tuning`` field at its default; ``defaults`` replaces a default by name (one the
        project computes, a tuning value a settings module chose)."""
        defaults = defaults or {}
        values: dict[str, Any] = {}
        for spec, kind in cls.specs():
            env = spec.metadata[ENV]
            default = defaults.get(env, spec.default)
            if spec.metadata[ENVIRONMENT]:
                values[spec.name] = read(env, kind, default)
            else:
                values[spec.name] = _as_type(env, kind, default)
        return cls(**values)

    @classmethod
    def from_django(cls, source: Any) -> CleanupSettings:
        """From Django's settings, each value converted to its field's type (a test may set
        ``CLEANUP_CAPACITY_HEADROOM = 0`` or a list of commands)."""
        values: dict[str, Any] = {}
        for spec, kind in cls.specs():
            env = spec.metadata[ENV]
            values[spec.name] = _as_type(env, kind, getattr(source, env, spec.default))
        return cls(**values)

    def as_django_settings(self) -> dict[str, object]:
        """``{variable: value}``: what ``config/settings/base.py`` publishes (lists, as
        Django's settings have always held them)."""
        return {
            spec.metadata[ENV]: list(value) if isinstance(value, tuple) else value
            for spec in dataclasses.fields(self)
            for value in [getattr(self, spec.name)]
        }


# Environment variables the cleanup no longer reads, and where each value lives now: a
# deployment that still sets one is refused at start-up, naming it (config.env.refuse_retired),
# instead of running without it.
RETIRED_VARIABLES: dict[str, str] = {
    **{
        spec.metadata[ENV]: (
            f"it is a Django setting only (default {spec.default!r}), which a deployment leaves "
            "at its default"
        )
        for spec in dataclasses.fields(CleanupSettings)
        if not spec.metadata[ENVIRONMENT]
    },
    "CLEANUP_AUTOSCALE_SERVICE_TIME": (
        "set CLEANUP_CAPACITY_PER_CONSUMER_PER_S instead (releases per second of one consumer: "
        "1 / the service time)"
    ),
    "CLEANUP_PRUNE_BATCH_SIZE": "it is a constant, cleanup.conf.PRUNE_BATCH_SIZE",
    "CLEANUP_RELAY_BATCH_SIZE": "it is a constant, cleanup.release.outbox.RELAY_BATCH_SIZE",
    "CLEANUP_DELIVERY_COUNTER_TTL": (
        "it is a constant, cleanup.release.delivery_cap.COUNTER_TTL_SECONDS"
    ),
    "CLEANUP_WORKER_ETA_TASK_LIMIT": (
        "it is a constant, cleanup.broker.celery_policy.ETA_TASK_LIMIT"
    ),
    "CLEANUP_PAUSE_POLL_INTERVAL": "it is a constant, cleanup.worker.pause_step.POLL_INTERVAL_S",
    "WORKER_NAME": "give the worker's name to `manage.py worker_health --name`",
    "CLEANUP_SWEEP_TURNS": (
        "it is gone: near the cap the room goes to the shards furthest behind; delete it"
    ),
}


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", tuple: "a list of strings"}


def _as_type(env: str, kind: type, value: Any) -> Any:
    """``value`` as a ``kind``, widening only what cannot lose anything (an int to a float, a
    list to a tuple); anything else is refused naming the setting (``str(None)`` would be a
    URL)."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is tuple and isinstance(value, list | tuple):
        if all(isinstance(item, str) for item in value):
            return tuple(value)
    elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ImproperlyConfigured(f"{env}={value!r} is not {_TYPE_NAMES[kind]}")


_cached: CleanupSettings | None = None


def cleanup_settings() -> CleanupSettings:
    """The cleanup's settings from ``django.conf.settings``, built once and again after any
    setting changes (``override_settings`` sends ``setting_changed``)."""
    global _cached
    if _cached is None:
        _cached = CleanupSettings.from_django(django_settings)
    return _cached


def _forget(**_: object) -> None:
    global _cached
    _cached = None


setting_changed.connect(_forget, dispatch_uid="cleanup.conf.forget")
