"""Settings shared by every environment. Every value comes from the environment through the
strict helpers in ``config.env``; a bad value fails at start-up and names the variable."""

from __future__ import annotations

from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from config.env import env_bool, env_float, env_int, env_list, env_str, parse_database_url

BASE_DIR = Path(__file__).resolve().parent.parent.parent

SECRET_KEY = env_str("SECRET_KEY")
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_beat",
    "reservations",
    "cleanup",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Serves the collected static files (the admin's) from the app server itself, with far-future
    # cache headers and compressed variants; the container image runs collectstatic at build.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": parse_database_url("DATABASE_URL", env_str("DATABASE_URL"))}
# Short-lived workers and web requests reuse a connection for a while; health checks drop dead ones.
DATABASES["default"]["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# The release statement runs prepared (reservations.db.fetch_prepared); false for a connection
# pooler that cannot keep prepared statements (PgBouncer in transaction mode before 1.21).
DATABASE_PREPARED_STATEMENTS = env_bool("DATABASE_PREPARED_STATEMENTS", True)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "var" / "static")))
# Compressed (gzip/brotli) variants written by collectstatic, served by WhiteNoise. Not the
# manifest variant: it refuses to render a template whose static file was never collected,
# which a fresh clone (tests, `make run`) has not done.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

# --- Reservations domain -------------------------------------------------------------------
RESERVATIONS_API_TOKEN = env_str("RESERVATIONS_API_TOKEN")
RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS = env_int(
    "RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS", 600, minimum=1
)
RESERVATIONS_MAX_HOLD_TTL_SECONDS = env_int("RESERVATIONS_MAX_HOLD_TTL_SECONDS", 86400, minimum=1)
RESERVATIONS_API_MAX_BODY_BYTES = env_int("RESERVATIONS_API_MAX_BODY_BYTES", 16384, minimum=256)

# --- Celery --------------------------------------------------------------------------------
# No default: local and test settings set a local Redis; production must name its broker.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL")
if not CELERY_BROKER_URL.startswith(("redis://", "rediss://", "amqp://", "amqps://", "pyamqp://")):
    raise ImproperlyConfigured(
        # The scheme only: the URL may carry a password.
        f"CELERY_BROKER_URL: expected a redis:// or amqp:// URL, not "
        f"{CELERY_BROKER_URL.partition('://')[0]!r}://"
    )
BROKER_IS_REDIS = CELERY_BROKER_URL.startswith(("redis://", "rediss://"))

CLEANUP_SWEEP_QUEUE = env_str("CLEANUP_SWEEP_QUEUE", "sweep")
CLEANUP_RELEASE_QUEUE = env_str("CLEANUP_RELEASE_QUEUE", "cleanup")
CLEANUP_MAINTENANCE_QUEUE = env_str("CLEANUP_MAINTENANCE_QUEUE", "maintenance")
CLEANUP_EVENTS_QUEUE = env_str("CLEANUP_EVENTS_QUEUE", "reservation-events")
# The largest message body a worker looks at; anything larger is dead-lettered unread
# (a batch of 1,000 holds is about 170 KB). See docs/HARDENING.md.
CLEANUP_MAX_MESSAGE_BYTES = env_int("CLEANUP_MAX_MESSAGE_BYTES", 1024 * 1024, minimum=64 * 1024)

# Time limits bound a stuck release; the soft limit leaves room to roll back and log. A release
# is one statement (milliseconds) and a sweep stops at its time budget, so 30 s is generous; it
# is kept short because the visibility timeout (below) must cover it, and that timeout is how
# long a lost node's messages wait before coming back.
CLEANUP_TASK_TIME_LIMIT = env_int("CLEANUP_TASK_TIME_LIMIT", 30, minimum=1)
CLEANUP_TASK_SOFT_TIME_LIMIT = env_int("CLEANUP_TASK_SOFT_TIME_LIMIT", 25, minimum=1)
# Retries: exponential backoff with full jitter, capped well below the visibility timeout.
CLEANUP_MAX_RETRIES = env_int("CLEANUP_MAX_RETRIES", 5, minimum=0)
CLEANUP_RETRY_BACKOFF_MAX = env_int("CLEANUP_RETRY_BACKOFF_MAX", 30, minimum=1)
# Deliveries of one idempotency key before the message is dead-lettered without any work: bounds
# a poison message that kills its worker (reject_on_worker_lost requeues it without limit).
CLEANUP_MAX_DELIVERIES = env_int("CLEANUP_MAX_DELIVERIES", 8, minimum=1)
CLEANUP_DELIVERY_COUNTER_TTL = env_int("CLEANUP_DELIVERY_COUNTER_TTL", 86400, minimum=60)
# Sweeps: a claim leases a hold for this long; after it a later sweep takes the hold again.
CLEANUP_LEASE_SECONDS = env_int("CLEANUP_LEASE_SECONDS", 300, minimum=1)
CLEANUP_SWEEP_BATCH_SIZE = env_int("CLEANUP_SWEEP_BATCH_SIZE", 500, minimum=1)
CLEANUP_SWEEP_MAX_BATCHES = env_int("CLEANUP_SWEEP_MAX_BATCHES", 20, minimum=1)
CLEANUP_MAX_CLAIMS = env_int("CLEANUP_MAX_CLAIMS", 10, minimum=1)
# A sweep stops starting new batches after this many seconds (default: half the soft time
# limit), so waiting for the publish lock or a slow broker never runs into the time limit.
CLEANUP_SWEEP_TIME_BUDGET = env_float("CLEANUP_SWEEP_TIME_BUDGET", 0, minimum=0)
# Backpressure: a sweep stops publishing while the release queue is deeper than this.
CLEANUP_MAX_QUEUE_DEPTH = env_int("CLEANUP_MAX_QUEUE_DEPTH", 20000, minimum=1)
# "adaptive" (default) = one message per hold at normal load, more holds per message (up to
# CLEANUP_RELEASE_BATCH_SIZE) when the backlog would push the oldest hold past
# CLEANUP_RELEASE_TARGET_SECONDS; "single" = always one message per hold; "batch" = always
# CLEANUP_RELEASE_BATCH_SIZE holds per message (docs/PIPELINE.md, "Release modes").
RELEASE_MODES = ("adaptive", "single", "batch")
CLEANUP_RELEASE_MODE = env_str("CLEANUP_RELEASE_MODE", "adaptive")
if CLEANUP_RELEASE_MODE not in RELEASE_MODES:
    raise ImproperlyConfigured(
        f"CLEANUP_RELEASE_MODE={CLEANUP_RELEASE_MODE!r}: expected one of "
        f"{', '.join(repr(m) for m in RELEASE_MODES)}"
    )
CLEANUP_RELEASE_BATCH_SIZE = env_int("CLEANUP_RELEASE_BATCH_SIZE", 100, minimum=1)
if CLEANUP_RELEASE_BATCH_SIZE > 1000:  # what a worker accepts (cleanup.pipeline.messages)
    raise ImproperlyConfigured(
        f"CLEANUP_RELEASE_BATCH_SIZE={CLEANUP_RELEASE_BATCH_SIZE} must be <= 1000"
    )
CLEANUP_RELEASE_TARGET_SECONDS = env_float("CLEANUP_RELEASE_TARGET_SECONDS", 10, minimum=0.1)
# How long a sweep waits in line for the publish lock (never past its time budget): a sweep
# waiting there occupies a pool process that could be releasing.
CLEANUP_SWEEP_LOCK_WAIT = env_float("CLEANUP_SWEEP_LOCK_WAIT", 2, minimum=0.05)
# Redis used for the delivery counter; defaults to the broker when the broker is Redis.
# With RabbitMQ and no Redis, deliveries are counted in PostgreSQL (autocommit upsert).
CLEANUP_COUNTER_REDIS_URL = env_str(
    "CLEANUP_COUNTER_REDIS_URL", CELERY_BROKER_URL if BROKER_IS_REDIS else ""
)
CLEANUP_RETENTION_DAYS = env_int("CLEANUP_RETENTION_DAYS", 14, minimum=1)
CLEANUP_PRUNE_BATCH_SIZE = env_int("CLEANUP_PRUNE_BATCH_SIZE", 5000, minimum=1)
# Resolved dead letters are deleted this many days after they were resolved (cleanup.prune).
CLEANUP_DEAD_LETTER_RETENTION_DAYS = env_int("CLEANUP_DEAD_LETTER_RETENTION_DAYS", 14, minimum=1)
# Open dead letters kept in full; the oldest beyond it are summarised (one open summary letter
# per reason and task) by cleanup.sample_health. docs/OPERATOR-CONSOLE.md, "Dead-letter triage".
CLEANUP_DEAD_LETTER_OPEN_CAP = env_int("CLEANUP_DEAD_LETTER_OPEN_CAP", 10000, minimum=1)
CLEANUP_RELAY_BATCH_SIZE = env_int("CLEANUP_RELAY_BATCH_SIZE", 500, minimum=1)
CLEANUP_SLO_SECONDS = env_int("CLEANUP_SLO_SECONDS", 300, minimum=1)
CLEANUP_ELIGIBLE_COUNT_CAP = env_int("CLEANUP_ELIGIBLE_COUNT_CAP", 100000, minimum=1)
CLEANUP_BEAT_LOCK_ID = env_int("CLEANUP_BEAT_LOCK_ID", 727_001)
CLEANUP_BEAT_IDLE_SESSION_TIMEOUT = env_int("CLEANUP_BEAT_IDLE_SESSION_TIMEOUT", 30, minimum=1)

# Redis visibility timeout: a message fetched but not acked comes back after this long — also
# when its worker is lost, so recovery after a node loss is about this + the restore interval
# (default 75 + 5 s, measured ≈ 80 s). The clock starts when the worker fetches the message, so
# it must exceed the longest a fetched message can stay unacked without anything being wrong:
# a retry is an ETA message held unacked in the worker for up to the backoff cap and then run
# for up to the hard time limit; longer, and a running or waiting task is delivered twice
# (docs/PIPELINE.md "Recovery times" has the trade-off; docs/LIBRARY-NOTES.md §2 the ETA case).
CLEANUP_VISIBILITY_TIMEOUT = env_int("CLEANUP_VISIBILITY_TIMEOUT", 75, minimum=1)
_longest_hold = CLEANUP_TASK_TIME_LIMIT + CLEANUP_RETRY_BACKOFF_MAX
if CLEANUP_VISIBILITY_TIMEOUT <= _longest_hold:
    raise ImproperlyConfigured(
        f"CLEANUP_VISIBILITY_TIMEOUT={CLEANUP_VISIBILITY_TIMEOUT} must exceed "
        f"CLEANUP_TASK_TIME_LIMIT + CLEANUP_RETRY_BACKOFF_MAX ({_longest_hold}): a retry waits "
        f"unacked for up to the backoff cap, then runs for up to the time limit"
    )
if CLEANUP_MAX_DELIVERIES <= CLEANUP_MAX_RETRIES:
    # Each Celery retry is a delivery too; a cap below the retries would dead-letter a message
    # that is merely retrying a transient error.
    raise ImproperlyConfigured(
        f"CLEANUP_MAX_DELIVERIES={CLEANUP_MAX_DELIVERIES} must exceed "
        f"CLEANUP_MAX_RETRIES={CLEANUP_MAX_RETRIES}"
    )
if not CLEANUP_SWEEP_TIME_BUDGET:
    CLEANUP_SWEEP_TIME_BUDGET = CLEANUP_TASK_SOFT_TIME_LIMIT / 2
if CLEANUP_TASK_SOFT_TIME_LIMIT >= CLEANUP_TASK_TIME_LIMIT:
    raise ImproperlyConfigured("CLEANUP_TASK_SOFT_TIME_LIMIT must be below CLEANUP_TASK_TIME_LIMIT")
# How often an idle consumer scans for unacked messages past the visibility timeout. kombu's
# default scans about every 100 s; one scan every few seconds bounds a dead worker's recovery
# at visibility_timeout + this interval.
CLEANUP_UNACKED_RESTORE_INTERVAL = env_int("CLEANUP_UNACKED_RESTORE_INTERVAL", 5, minimum=1)

CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if BROKER_IS_REDIS:
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": CLEANUP_VISIBILITY_TIMEOUT,
        "unacked_restore_interval": CLEANUP_UNACKED_RESTORE_INTERVAL,
        "unacked_restore_throttle": 1,
    }
if CELERY_BROKER_URL.startswith("redis://"):
    # kombu's Redis transport with every list entry screened before kombu decodes it.
    CELERY_BROKER_TRANSPORT = "cleanup.worker.redis_transport:Transport"
elif CELERY_BROKER_URL.startswith(("amqp://", "pyamqp://", "amqps://")):
    # kombu's py-amqp transport with every content header screened before py-amqp decodes it.
    CELERY_BROKER_TRANSPORT = "cleanup.worker.amqp_transport:" + (
        "SSLTransport" if CELERY_BROKER_URL.startswith("amqps://") else "Transport"
    )
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# JSON only: a pickle payload would execute code; anything else is rejected and dead-lettered.
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_SERIALIZER = "json"
# Outcomes live in PostgreSQL (receipts); no result backend round trip per task.
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
# Acknowledge after the durable write; a lost pool child puts its message back
# (docs/PIPELINE.md, invariant 4).
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# A hard time limit must ack, not requeue (requeue loops forever — docs/LIBRARY-NOTES.md §2); the
# delivery counter and the dead letter written in on_failure account for it.
CELERY_TASK_ACKS_ON_FAILURE_OR_TIMEOUT = True
# Messages each pool process may hold beyond the one it runs is this minus one. 1 (the default)
# keeps every waiting message in the broker, where any idle worker can take it, and leaves
# the fewest messages behind a lost worker (each waits for the visibility timeout); higher
# values hide the broker round trip between two tasks (docs/PERFORMANCE.md measures both).
CELERY_WORKER_PREFETCH_MULTIPLIER = env_int("CELERY_WORKER_PREFETCH_MULTIPLIER", 1, minimum=1)
CELERY_TASK_TIME_LIMIT = CLEANUP_TASK_TIME_LIMIT
CELERY_TASK_SOFT_TIME_LIMIT = CLEANUP_TASK_SOFT_TIME_LIMIT
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_TASK_DEFAULT_QUEUE = CLEANUP_RELEASE_QUEUE
CELERY_TASK_QUEUES = [
    Queue(CLEANUP_SWEEP_QUEUE, routing_key=CLEANUP_SWEEP_QUEUE),
    Queue(CLEANUP_RELEASE_QUEUE, routing_key=CLEANUP_RELEASE_QUEUE),
    Queue(CLEANUP_MAINTENANCE_QUEUE, routing_key=CLEANUP_MAINTENANCE_QUEUE),
]
CELERY_TASK_ROUTES = {
    "cleanup.sweep_shard": {"queue": CLEANUP_SWEEP_QUEUE},
    "cleanup.release_reservation": {"queue": CLEANUP_RELEASE_QUEUE},
    "cleanup.release_batch": {"queue": CLEANUP_RELEASE_QUEUE},
    "cleanup.*": {"queue": CLEANUP_MAINTENANCE_QUEUE},
}
# Flower shows nothing without task events; the benchmark measures their cost.
CELERY_WORKER_SEND_TASK_EVENTS = env_bool("CELERY_TASK_EVENTS", True)
CELERY_TASK_SEND_SENT_EVENT = CELERY_WORKER_SEND_TASK_EVENTS
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULER = "cleanup.pipeline.schedule:LeaderDatabaseScheduler"
# Persist last_run_at after every send so a new beat leader does not re-send
# (docs/LIBRARY-NOTES.md §4).
CELERY_BEAT_SYNC_EVERY = 1
CELERY_BEAT_MAX_LOOP_INTERVAL = env_int("CELERY_BEAT_MAX_LOOP_INTERVAL", 5, minimum=1)
CELERY_TIMEZONE = "UTC"

# --- Observability -------------------------------------------------------------------------
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
METRICS_ALLOW_IPS = env_list("METRICS_ALLOW_IPS", [])
METRICS_STATEMENT_TIMEOUT_MS = env_int("METRICS_STATEMENT_TIMEOUT_MS", 2000, minimum=1)
WORKER_METRICS_PORT = env_int("WORKER_METRICS_PORT", 0, minimum=0)
# The worker metrics endpoint has no authentication: loopback unless a deployment binds it to
# the private network its Prometheus scrapes from (compose does).
WORKER_METRICS_ADDR = env_str("WORKER_METRICS_ADDR", "127.0.0.1")
# How often a worker's main process folds dead pool children's metric files into an archive.
WORKER_METRICS_COMPACT_INTERVAL = env_float("WORKER_METRICS_COMPACT_INTERVAL", 30, minimum=0.1)
# Inputs of cleanup.scaling.capacity.desired_consumers (the desired_consumers gauge, the
# autoscaler): a planned peak arrival rate (a floor under the measured one), the measured
# per-consumer rate from a burst report (else the receipts' mean duration is used), and retry
# headroom.
CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S = env_float(
    "CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S", 0, minimum=0
)
CLEANUP_CAPACITY_PER_CONSUMER_PER_S = env_float("CLEANUP_CAPACITY_PER_CONSUMER_PER_S", 0, minimum=0)
CLEANUP_CAPACITY_HEADROOM = env_float("CLEANUP_CAPACITY_HEADROOM", 0.5, minimum=0)
# The pool autoscaler (cleanup.scaling.autoscale, used with `celery worker --autoscale=MAX,MIN`):
# how often it reads the backlog, the window its rates are measured over, the fraction of the SLO
# the oldest eligible hold may reach before the backlog must be drained, the utilization target,
# how long a lower target must persist before the pool shrinks, and the service time per pool
# process assumed until one is measured (CLEANUP_CAPACITY_PER_CONSUMER_PER_S overrides both).
CLEANUP_AUTOSCALE_INTERVAL = env_float("CLEANUP_AUTOSCALE_INTERVAL", 5, minimum=0.2)
CLEANUP_AUTOSCALE_WINDOW = env_float("CLEANUP_AUTOSCALE_WINDOW", 60, minimum=1)
CLEANUP_AUTOSCALE_SLO_TARGET = env_float("CLEANUP_AUTOSCALE_SLO_TARGET", 0.5, minimum=0.01)
CLEANUP_AUTOSCALE_UTILIZATION = env_float("CLEANUP_AUTOSCALE_UTILIZATION", 0.7, minimum=0.01)
CLEANUP_AUTOSCALE_COOLDOWN = env_float("CLEANUP_AUTOSCALE_COOLDOWN", 60, minimum=0)
CLEANUP_AUTOSCALE_SERVICE_TIME = env_float("CLEANUP_AUTOSCALE_SERVICE_TIME", 0.05, minimum=0.0001)
CLEANUP_AUTOSCALE_STATEMENT_TIMEOUT_MS = env_int(
    "CLEANUP_AUTOSCALE_STATEMENT_TIMEOUT_MS", 2000, minimum=1
)
if CLEANUP_AUTOSCALE_SLO_TARGET > 1 or CLEANUP_AUTOSCALE_UTILIZATION > 1:
    raise ImproperlyConfigured(
        "CLEANUP_AUTOSCALE_SLO_TARGET and CLEANUP_AUTOSCALE_UTILIZATION must be <= 1"
    )
# Only used when a worker runs with --autoscale; without it the pool has a fixed size.
CELERY_WORKER_AUTOSCALER = "cleanup.scaling.autoscale:BacklogAutoscaler"
LOG_FORMAT = env_str("LOG_FORMAT", "text")
if LOG_FORMAT not in {"text", "json"}:
    raise ImproperlyConfigured(f"LOG_FORMAT={LOG_FORMAT!r}: expected 'text' or 'json'")
LOG_LEVEL = env_str("LOG_LEVEL", "INFO").upper()

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "text": {"()": "config.logging.KeyValueFormatter"},
        "json": {"()": "config.logging.JsonFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        # Celery's per-task "received"/"succeeded" lines duplicate our one structured line per
        # attempt (cleanup.tasks) and cost throughput; keep their warnings and errors.
        "celery.app.trace": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
    },
}

# Undecodable messages are dead-lettered before Celery acks them (cleanup.worker.consumer).
CELERY_WORKER_CONSUMER = "cleanup.worker.consumer:DeadLetteringConsumer"
# Remote control (the pidbox broadcast channel): anyone who can write to the broker can send a
# command, so a worker runs only these and drops the rest with a log line and a counted metric
# (cleanup.worker.remote_control). The default is what `manage.py worker_health`,
# `celery inspect` and Flower's read-only pages use; add e.g. pool_grow or shutdown only
# with a broker you trust.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = env_bool("CELERY_WORKER_ENABLE_REMOTE_CONTROL", True)
CLEANUP_REMOTE_CONTROL_COMMANDS = env_list(
    "CLEANUP_REMOTE_CONTROL_COMMANDS",
    [
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
    ],
)
