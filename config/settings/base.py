"""Settings shared by every environment. Every value a deployment decides comes from the
environment through the strict helpers in ``config.env``; a bad value fails at start-up and
names the variable, and so does a variable that is no longer read (``_RETIRED``). The rest are
constants here, or the cleanup's tuning settings (``cleanup.conf``, ``config.settings.tuning``).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from cleanup import conf as cleanup_conf
from cleanup import error_reports
from cleanup.broker import celery_policy, queues
from cleanup.conf import CleanupSettings
from config import redis_tls
from config.env import (
    POOLING_MODES,
    SESSION_ALIAS,
    database_aliases,
    env_bool,
    env_choice,
    env_int,
    env_list,
    env_str,
    env_typed,
    parse_database_url,
    prepared_statements,
    refuse_retired,
)
from config.settings import tuning
from reservations import redis_sentinel

BASE_DIR = Path(__file__).resolve().parent.parent.parent

# Variables this project no longer reads (the cleanup's own: cleanup.conf.RETIRED_VARIABLES),
# and where each value lives now; one still set fails the start naming it.
_RETIRED = {
    "CELERY_BEAT_MAX_LOOP_INTERVAL": "it is the Django setting of that name (5 s)",
    "CELERY_DB_REUSE_MAX": "it is a constant, cleanup.broker.celery_policy.DB_REUSE_MAX",
    "CELERY_TASK_EVENTS": (
        "task events are always sent (Flower shows nothing without them); a benchmark turns "
        "them off with the Django settings CELERY_WORKER_SEND_TASK_EVENTS and "
        "CELERY_TASK_SEND_SENT_EVENT"
    ),
    "CELERY_WORKER_ENABLE_REMOTE_CONTROL": (
        "CLEANUP_REMOTE_CONTROL_COMMANDS=none turns remote control off"
    ),
    "CONTENT_SECURITY_POLICY": "it is the Django setting of that name",
    "DATABASE_PREPARED_STATEMENTS": (
        "the release statement runs prepared unless DATABASE_POOLING=transaction"
    ),
    "RESERVATIONS_API_MAX_BODY_BYTES": "it is the Django setting of that name (16384)",
}
refuse_retired({**cleanup_conf.RETIRED_VARIABLES, **_RETIRED})

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
    # Admin login throttling (below: "Admin login").
    "axes",
    "django_celery_beat",
    # The API's OpenAPI document and its Swagger UI (templates and bundled static files).
    "ninja",
    "reservations",
    "cleanup",
    # The example project's tooling (the burst drill's command); not part of the product.
    "tools",
]

MIDDLEWARE = [
    # First: its time covers the rest (request counts and latency by route and status).
    "cleanup.operations.request_metrics.RequestMetricsMiddleware",
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
    "config.security.ContentSecurityPolicyMiddleware",
    # Sets the known-device cookie on a successful admin login (config/admin_login.py).
    "config.admin_login.KnownDeviceMiddleware",
    # Last, as django-axes asks: it answers a locked-out login after the view ran.
    "axes.middleware.AxesMiddleware",
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

# How DATABASE_URL reaches PostgreSQL (config.env.POOLING_MODES); behind a transaction pooler
# the session state (advisory locks, the beat's lease) goes over DATABASE_DIRECT_URL, and the
# processes that need it refuse to start when a pooler is found but not declared
# (reservations.pooling; docs/TOPOLOGIES.md, "PgBouncer").
DATABASE_POOLING = env_choice("DATABASE_POOLING", POOLING_MODES, "none")
DATABASE_DIRECT_URL = env_str("DATABASE_DIRECT_URL", "")
# Probed at start-up whenever it is given (it must not be transaction pooled either).
DATABASE_DIRECT = (
    parse_database_url("DATABASE_DIRECT_URL", DATABASE_DIRECT_URL) if DATABASE_DIRECT_URL else None
)
DATABASES = database_aliases(
    env_str("DATABASE_URL"),
    DATABASE_DIRECT_URL,
    DATABASE_POOLING,
    conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0),
)
# The alias whose connection holds session state (reservations.db.session_connection).
DATABASE_SESSION_ALIAS = SESSION_ALIAS if SESSION_ALIAS in DATABASES else "default"
# The release statement runs prepared (reservations.db.fetch_prepared), except behind a transaction
# pooler, which cannot keep prepared statements (PgBouncer in transaction mode before 1.21).
DATABASE_PREPARED_STATEMENTS = prepared_statements(DATABASE_POOLING)
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

# --- Admin login ---------------------------------------------------------------------------
# Staff passwords: Django's four validators (similar to the user, shorter than the minimum,
# a common password, all digits), applied by the admin's password forms and createsuperuser.
ADMIN_PASSWORD_MIN_LENGTH = env_int("ADMIN_PASSWORD_MIN_LENGTH", 12, minimum=8)
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": ADMIN_PASSWORD_MIN_LENGTH},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# django-axes: after AXES_FAILURE_LIMIT failed logins for one username from one client address,
# that pair is refused (even with the right password, answered 429) for AXES_COOLOFF_MINUTES.
# Keyed on the pair so that a stranger cannot lock a staff member out from elsewhere; and once a
# username has LOGIN_USERNAME_FAILURE_LIMIT failures from any addresses, it is refused to every
# browser that has not logged in as that user before (config/admin_login.py says how).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("AXES_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = "config.admin_login.lockout_parameters"
AXES_RESET_ON_SUCCESS = True
# Four addresses' worth: each address counts up to AXES_FAILURE_LIMIT, so one address alone
# never reaches it. Derived, not read from the environment: one knob fewer.
LOGIN_USERNAME_FAILURE_LIMIT = 4 * AXES_FAILURE_LIMIT
# The proxies in front of the web that append the client's address to X-Forwarded-For (a load
# balancer, an ingress): the client's address is the TRUSTED_PROXY_COUNT-th entry from the
# right. 0: REMOTE_ADDR, the header ignored (any client can write it). Behind a proxy, 0 makes
# every visitor share the proxy's address; too high a count lets a client pick its own.
TRUSTED_PROXY_COUNT = env_int("TRUSTED_PROXY_COUNT", 0, minimum=0)
MAX_TRUSTED_PROXY_COUNT = 5
if TRUSTED_PROXY_COUNT > MAX_TRUSTED_PROXY_COUNT:
    raise ImproperlyConfigured(
        f"TRUSTED_PROXY_COUNT={TRUSTED_PROXY_COUNT} must be <= {MAX_TRUSTED_PROXY_COUNT}: the "
        "number of proxies in front of the web that append to X-Forwarded-For"
    )
AXES_CLIENT_IP_CALLABLE = "config.admin_login.client_ip"
# Pages load scripts, styles and images from this site only; inline style attributes stay
# allowed (the admin's widgets and the health page's bars use them), inline scripts do not. The
# pages are the project's own, so the policy is too: a constant, not a deployment's choice.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; object-src 'none'; base-uri 'self'; form-action 'self'; "
    "frame-ancestors 'none'"
)

# --- Reservations domain -------------------------------------------------------------------
# The one shared bearer token, for local development and tests only (empty: off); production
# refuses it. Every other caller is an API client with its own tokens (reservations.clients).
RESERVATIONS_API_TOKEN = env_str("RESERVATIONS_API_TOKEN", "")
# How long a response stays replayable under its Idempotency-Key (reservations.idempotency).
RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS = env_int(
    "RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS", 86400, minimum=60
)
RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS = env_int(
    "RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS", 600, minimum=1
)
RESERVATIONS_MAX_HOLD_TTL_SECONDS = env_int("RESERVATIONS_MAX_HOLD_TTL_SECONDS", 86400, minimum=1)
# The largest request body the API reads: its largest request (a hold with metadata) is well
# under 2 KB, so 16 KB refuses only what is not a request of this API.
RESERVATIONS_API_MAX_BODY_BYTES = 16384

# --- Celery --------------------------------------------------------------------------------
# No default: local and test settings set a local Redis; production must name its broker.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL")
if not CELERY_BROKER_URL.startswith(
    ("redis://", "rediss://", "sentinel://", "amqp://", "amqps://", "pyamqp://")
):
    raise ImproperlyConfigured(
        # The scheme only: the URL may carry a password.
        f"CELERY_BROKER_URL: expected a redis://, rediss://, sentinel:// or amqp:// URL, not "
        f"{CELERY_BROKER_URL.partition('://')[0]!r}://"
    )
# A RabbitMQ cluster: every node's URL, separated by ";" (kombu tries the next on a failed
# connection). One scheme for all: the first entry's selects the (plain or TLS) transport.
if CELERY_BROKER_URL.startswith(("amqp://", "amqps://", "pyamqp://")):
    _schemes = {entry.strip().partition("://")[0] for entry in CELERY_BROKER_URL.split(";")}
    if len(_schemes) > 1:
        raise ImproperlyConfigured(
            f"CELERY_BROKER_URL: every entry of a RabbitMQ URL list must have the same scheme, "
            f"not {', '.join(sorted(repr(s + '://') for s in _schemes))}"
        )
# Redis Sentinel: the sentinels in the URL, the master's name here (reservations.redis_sentinel).
BROKER_IS_SENTINEL = redis_sentinel.is_sentinel(CELERY_BROKER_URL)
CELERY_BROKER_SENTINEL_MASTER = env_str(redis_sentinel.MASTER_VARIABLE, "").strip()
BROKER_IS_REDIS = CELERY_BROKER_URL.startswith(("redis://", "rediss://")) or BROKER_IS_SENTINEL

# The cleanup's settings are declared (type, default, bound, one-line doc) and cross-checked in
# cleanup.conf.CleanupSettings; they are read here, from the environment, so a bad value fails
# at start-up naming its variable, and published under their variables' names
# (CLEANUP_RELEASE_QUEUE, METRICS_TOKEN, ...), where cleanup.conf.cleanup_settings() and the
# tests' overrides find them. docs/ARCHITECTURE.md, "Settings".
_cleanup = CleanupSettings.from_environment(
    env_typed,
    defaults={
        # The tuning values a settings module built on this one chose (config.settings.tuning).
        **tuning.VALUES,
        # The delivery counters live in the broker's Redis when it is Redis; with RabbitMQ and
        # no Redis they are counted in PostgreSQL (autocommit upsert).
        "CLEANUP_COUNTER_REDIS_URL": CELERY_BROKER_URL if BROKER_IS_REDIS else "",
    },
)
globals().update(_cleanup.as_django_settings())

if BROKER_IS_REDIS and queues.is_quorum(_cleanup):
    raise ImproperlyConfigured(
        "CLEANUP_RABBITMQ_QUEUE_TYPE=quorum needs a RabbitMQ broker (an amqp:// "
        "CELERY_BROKER_URL); with Redis leave it 'classic'"
    )

# TLS for every rediss:// client of the project (broker, counters, readers): from the URL's
# query or the REDIS_TLS_* settings (config.redis_tls).
REDIS_TLS_OPTIONS = redis_tls.options_from_environment()
redis_sentinel.check(
    CELERY_BROKER_URL,
    _cleanup.counter_redis_url,
    CELERY_BROKER_SENTINEL_MASTER,
    redis_tls.explicit_settings(),
)
# kombu's Sentinel connection logic takes the master's name as a transport option.
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = (
    {"master_name": CELERY_BROKER_SENTINEL_MASTER} if BROKER_IS_SENTINEL else {}
)
if BROKER_IS_REDIS and redis_tls.is_tls(CELERY_BROKER_URL):
    # kombu reads TLS options from the URL's query itself; otherwise it must be given them
    # (named transport or not, it would otherwise connect without TLS, or without checks).
    CELERY_BROKER_USE_SSL = (
        redis_tls.for_url("CELERY_BROKER_URL", CELERY_BROKER_URL, REDIS_TLS_OPTIONS) or None
    )
# A mix of URL options and settings is refused at start-up for every Redis URL.
if _cleanup.counter_redis_url != CELERY_BROKER_URL:
    redis_tls.for_url("CLEANUP_COUNTER_REDIS_URL", _cleanup.counter_redis_url, REDIS_TLS_OPTIONS)
# Messages each pool process may hold beyond the one it runs is this minus one (1: every
# waiting message stays in the broker, where any idle worker can take it).
CELERY_WORKER_PREFETCH_MULTIPLIER = env_int("CELERY_WORKER_PREFETCH_MULTIPLIER", 1, minimum=1)
# The apps' delivery policy (cleanup.broker.celery_policy), which their Celery app applies over
# these settings whatever they say; published here too, under Django's names, so that the
# settings show what the workers run with. Its defaults (task events on, beat's 5 s loop) too.
globals().update(celery_policy.as_django_settings(celery_policy.DEFAULTS))
globals().update(
    celery_policy.as_django_settings(
        celery_policy.policy(_cleanup, CELERY_BROKER_URL, CELERY_BROKER_TRANSPORT_OPTIONS)
    )
)

# --- Observability and scaling (their settings: cleanup.conf) -----------------------------
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

# --- The JSON API's request ids and problem answers (reservations.problems) ----------------
# First, so every other middleware's log lines under /api/v1/ carry the request's id too.
MIDDLEWARE.insert(0, "reservations.problems.ApiRequestMiddleware")
LOGGING["filters"] = {
    "request_id": {"()": "reservations.problems.RequestIdLogFilter"},
    # trace_id and span_id of the current OpenTelemetry span (docs/TRACING.md)
    "trace_context": {"()": "config.logging.TraceContextLogFilter"},
}
LOGGING["handlers"]["console"]["filters"] = ["request_id", "trace_context"]  # type: ignore[index]

# --- The JSON API's rate limits (reservations.ratelimit) ------------------------------------
# RESERVATIONS_API_RATE_LIMIT_REDIS_URL is left unset: the limiter counts in the cleanup's
# counter Redis (CLEANUP_COUNTER_REDIS_URL, the broker's by default, with its TLS options).

# --- Error reports (cleanup.error_reports): Sentry when SENTRY_DSN is set, scrubbed ---------
# sentry-sdk reads SENTRY_DSN itself; traces are OpenTelemetry's (cleanup.tracing, started per
# process after any fork: config/wsgi.py, cleanup.worker.signals). docs/TRACING.md.
error_reports.configure()
