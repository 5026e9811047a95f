"""The delivery policy of the apps' Celery app: what every worker and beat of it runs under,
whatever the Django settings say.

JSON only; acknowledged after the durable write, and a lost pool child's message put back; the
project's task queues and routes and nowhere else; kombu's transports with every message
screened before it is decoded; the consumer that dead-letters what it cannot decode; beat's
database scheduler under its lock. ``policy`` computes it from the cleanup's settings and the
broker's URL; ``cleanup.broker.celery_app`` applies it over the ``CELERY_`` settings once they
are loaded (so no setting can turn ``acks_late`` off), and the example project's settings
publish the same values (``as_django_settings``). docs/INTEGRATION.md, "Celery".

A leaf of the broker floor: settings modules import it at start-up, before any app is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings as django_settings

from cleanup import wire
from cleanup.broker import queues
from cleanup.conf import CleanupSettings
from reservations import redis_sentinel

# Celery's Django fixup closes every database connection before and after *each task* unless
# this is set (celery/fixups/django.py: close_database), so each release would open a new
# PostgreSQL connection (~10 ms here, more than the release itself). A connection is reused for
# this many tasks instead; Django's CONN_MAX_AGE and health checks still retire an old or broken
# one, and a broken one surfaces as a transient error and is retried.
DB_REUSE_MAX = 1000
# Celery holds each message with an eta (a retry waiting out its backoff) in the worker's memory
# until it is due and raises the prefetch count for it: without a limit a flood of them grows the
# main process at will. 64 is far more retries than a worker's few pool processes have waiting
# at once while anything is healthy.
ETA_TASK_LIMIT = 64
REDIS_SCHEMES = ("redis://", "rediss://")
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")

# What a deployment may choose (Celery's own settings, ``CELERY_`` in Django's): these are only
# the defaults. Messages each pool process may hold beyond the one it runs is the prefetch
# multiplier minus one: 1 keeps every waiting message in the broker, where any idle worker can
# take it (docs/PERFORMANCE.md measures more). Flower shows nothing without task events. Beat
# wakes at least every 5 s to find due entries and the admin's edits.
DEFAULTS: dict[str, Any] = {
    "worker_prefetch_multiplier": 1,
    "worker_send_task_events": True,
    "task_send_sent_event": True,
    "beat_max_loop_interval": 5,
    "timezone": "UTC",
}


def is_redis(broker_url: str) -> bool:
    return broker_url.startswith(REDIS_SCHEMES) or redis_sentinel.is_sentinel(broker_url)


def broker_is_redis() -> bool:
    """Whether the broker is Redis (plain, TLS or Sentinel): as the settings state it
    (``BROKER_IS_REDIS``), else from ``CELERY_BROKER_URL``."""
    stated = getattr(django_settings, "BROKER_IS_REDIS", None)
    if stated is not None:
        return bool(stated)
    return is_redis(str(django_settings.CELERY_BROKER_URL))


def transport(broker_url: str) -> str:
    """kombu's transport for the URL, with every message screened before kombu or py-amqp
    decodes it (``cleanup.worker.redis_transport``, ``cleanup.worker.amqp_transport``); TLS or
    not, the screening does not depend on the socket."""
    if redis_sentinel.is_sentinel(broker_url):
        return "cleanup.worker.redis_transport:SentinelTransport"
    if broker_url.startswith(REDIS_SCHEMES):
        return "cleanup.worker.redis_transport:Transport"
    if broker_url.startswith("amqps://"):
        return "cleanup.worker.amqp_transport:SSLTransport"
    return "cleanup.worker.amqp_transport:Transport"


def policy(
    conf: CleanupSettings, broker_url: str, transport_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Celery's settings (lower-case names) the apps' tasks need, for this broker: the
    deployment's own ``transport_options`` (a Sentinel master's name) kept, the visibility
    timeout and restore interval of the cleanup's settings added on Redis."""
    options = dict(transport_options or {})
    if is_redis(broker_url):
        options.update(
            visibility_timeout=conf.visibility_timeout,
            unacked_restore_interval=conf.unacked_restore_interval,
            unacked_restore_throttle=1,
        )
    settings: dict[str, Any] = {
        "broker_transport": transport(broker_url),
        "broker_transport_options": options,
        "broker_connection_retry_on_startup": True,
        # JSON only: a pickle payload would execute code; anything else is dead-lettered.
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        # Outcomes live in PostgreSQL (receipts); no result backend round trip per task.
        "task_ignore_result": True,
        "result_backend": None,
        # Acknowledge after the durable write; a lost pool child puts its message back
        # (docs/PIPELINE.md, invariant 4). A hard time limit acks (a requeue would loop
        # forever, docs/LIBRARY-NOTES.md §2): the delivery counter and the dead letter written
        # in on_failure account for it.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_eta_task_limit": ETA_TASK_LIMIT,
        "task_time_limit": conf.task_time_limit,
        "task_soft_time_limit": conf.task_soft_time_limit,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # Sweeps to the sweep queue, releases to the release queue, the rest to maintenance;
        # a queue not declared here is refused, not created (cleanup.broker.routes).
        "task_default_queue": conf.release_queue,
        "task_queues": queues.task_queues(conf),
        "task_routes": {
            **wire.task_routes(conf),
            **{name: {"queue": queue} for name, queue in conf.extra_routes().items()},
        },
        "task_create_missing_queues": False,
        # Celery's default, stated: with quorum queues each consumer's prefetch is set per
        # consumer, as with classic queues.
        "worker_detect_quorum_queues": True,
        "worker_hijack_root_logger": False,
        # Undecodable messages are dead-lettered before Celery acks them.
        "worker_consumer": "cleanup.worker.consumer:DeadLetteringConsumer",
        # Remote control runs only the commands CLEANUP_REMOTE_CONTROL_COMMANDS allows
        # (cleanup.worker.remote_control), and none with "none".
        "worker_enable_remote_control": bool(conf.remote_control_commands),
        # Only used when a worker runs with --autoscale.
        "worker_autoscaler": "cleanup.operations.scaling.autoscale:BacklogAutoscaler",
        "beat_scheduler": "cleanup.release.schedule:LeaderDatabaseScheduler",
        # last_run_at persisted after every send, so a new beat leader does not re-send
        # (docs/LIBRARY-NOTES.md §4).
        "beat_sync_every": 1,
    }
    if queues.is_quorum(conf):
        # Replicated quorum queues on a topic exchange, which Celery's native delayed delivery
        # of a retry needs (docs/TOPOLOGIES.md, "RabbitMQ cluster").
        settings["task_default_exchange"] = queues.task_exchange_name(conf)
        settings["task_default_exchange_type"] = queues.task_exchange_type(conf)
    return settings


def as_django_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """``policy``'s (or ``DEFAULTS``') values under their Django names (``CELERY_`` + upper)."""
    return {"CELERY_" + name.upper(): value for name, value in values.items()}
