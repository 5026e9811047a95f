"""Celery signal handlers: stamp ``enqueued_at`` on every publish; dead-letter what never
reaches task code (unknown task names, rejected content); refuse to start a worker or beat
behind a transaction pooler that the settings do not declare (reservations.pooling), or on RabbitMQ
queues of another type than CLEANUP_RABBITMQ_QUEUE_TYPE (cleanup.broker.queues)."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.signals import (
    beat_init,
    before_task_publish,
    task_rejected,
    task_unknown,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
)
from django.core.exceptions import ImproperlyConfigured

from cleanup import tracing
from cleanup.broker import queues
from cleanup.broker.celery_app import app, runs_this_app
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import dead_letters, delivery_cap
from reservations import pooling

logger = logging.getLogger("cleanup.worker")


@before_task_publish.connect
def stamp_enqueued_at(headers: dict[str, Any] | None = None, **_: Any) -> None:
    # A fresh stamp per publish (retries included): queue age is time spent in this queue.
    if headers is not None:
        headers["enqueued_at"] = time.time()


@worker_init.connect
@beat_init.connect
def refuse_a_transaction_pooler(sender: Any = None, **_: Any) -> None:
    """Before the worker's pool or beat's loop starts: their session locks and lease would not
    hold behind an undeclared transaction pooler. SystemExit, because Celery logs and ignores an
    exception a signal handler raises (and an embedded beat, ``worker -B``, starts with its
    worker)."""
    if not runs_this_app(sender):
        return
    problems = pooling.configured_refusals()
    if problems:
        raise SystemExit("refusing to start: " + "; ".join(problems))


@worker_init.connect
def refuse_queues_of_another_type(sender: Any = None, **_: Any) -> None:
    """Before the worker consumes: declare the project's task queues on RabbitMQ, and refuse to
    start, naming CLEANUP_RABBITMQ_QUEUE_TYPE and the queue, when RabbitMQ refuses one because
    it exists as another type (or with another delivery limit). Celery's own declaration would
    take the refusal for a lost channel and retry it for ever. A broker that cannot be reached
    now is left to Celery's reconnection."""
    if not runs_this_app(sender):
        return
    conn = app.connection_for_write()
    try:
        if conn.transport.driver_type != "amqp":
            return
        # RabbitMQ 3.x quorum queues have no priorities: whatever configured them is refused
        queues.check_priorities(
            cleanup_settings(),
            app.amqp.queues.values(),
            app.conf.task_queue_max_priority,
        )
        conn.ensure_connection(max_retries=2, interval_start=1, interval_max=1)
        refusals = queues.declaration_refusals(
            conn.default_channel,
            [app.amqp.queues[name] for name in sorted(app.amqp.queues)],
            cleanup_settings().rabbitmq_queue_type,
        )
    except ImproperlyConfigured as exc:
        raise SystemExit(f"refusing to start: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the broker's availability is Celery's to handle
        logger.warning("queue declarations not checked", extra={"error": repr(exc)[:300]})
        return
    finally:
        conn.release()
    if refusals:
        raise SystemExit("refusing to start: " + "; ".join(refusals))


# A dead letter keeps the start of a body; the rest is never decoded or copied.
RAW_BODY_LIMIT = 8192


def _raw(message: Any) -> dict[str, Any]:
    """A bounded, JSON-safe description of a broker message (never raises)."""
    try:
        body = message.body
    except Exception:  # noqa: BLE001
        body = None
    size = len(body) if isinstance(body, bytes | bytearray | str) else None
    if isinstance(body, bytes | bytearray):
        body = bytes(body[:RAW_BODY_LIMIT]).decode("utf-8", "replace")
    elif isinstance(body, str):
        body = body[:RAW_BODY_LIMIT]
    return {
        "headers": _bounded(getattr(message, "headers", None)),
        "content_type": _bounded(getattr(message, "content_type", None)),
        "content_encoding": _bounded(getattr(message, "content_encoding", None)),
        "delivery_info": _bounded(getattr(message, "delivery_info", None)),
        "body_bytes": size,
        "body": body,
    }


def _bounded(value: Any, limit: int = 2048) -> Any:
    """Small JSON-safe values as they are; anything else as a cut repr."""
    if value is None or isinstance(value, bool | int | float):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text[:limit]


def _header(message: Any, name: str, limit: int) -> str:
    headers = getattr(message, "headers", None)
    value = headers.get(name, "") if isinstance(headers, dict) else ""
    return value[:limit] if isinstance(value, str) else repr(value)[:limit]


def dead_letter_message(message: Any, reason: str, error: str) -> None:
    """A dead letter for a broker message that never reached a task (never raises)."""

    dead_letters.record(
        reason,
        error=error,
        task_name=_header(message, "task", 200),
        task_id=_header(message, "id", 64),
        payload=_raw(message),
    )


@worker_process_shutdown.connect
def flush_attempt_tally(**_: Any) -> None:
    """A pool process that stops adds what it has tallied (cleanup.release.delivery_cap)."""
    delivery_cap.flush_tally()


@worker_process_init.connect
def trace_the_pool_process(**_: Any) -> None:
    """Tracing (cleanup.tracing) in each prefork pool process, after the fork: the batch
    processor's export thread is this process's own. Off unless an OTLP endpoint is set."""
    tracing.configure("worker")


@worker_init.connect
def trace_a_pool_without_processes(sender: Any = None, **_: Any) -> None:
    """The solo, threads, gevent and eventlet pools run tasks in the worker's own process."""
    if runs_this_app(sender) and "prefork" not in _pool_name(sender):
        tracing.configure("worker")


@beat_init.connect
def trace_beat(sender: Any = None, **_: Any) -> None:
    """beat's sends start the traces of the sweeps (one trace per fan-out)."""
    if runs_this_app(sender):
        tracing.configure("beat")


@worker_process_shutdown.connect
def flush_spans(**_: Any) -> None:
    tracing.shutdown()


def _pool_name(worker: Any) -> str:
    pool = getattr(worker, "pool_cls", "")
    name = pool if isinstance(pool, str) else f"{pool.__module__}.{pool.__name__}"
    return name.lower()


@task_unknown.connect
def dead_letter_unknown_task(
    sender: Any = None,
    message: Any = None,
    exc: Any = None,
    name: str = "",
    id: str = "",
    **_: Any,
) -> None:
    if not runs_this_app(sender):
        return
    dead_letters.record(
        DeadLetter.Reason.UNKNOWN_TASK,
        error=f"no task named {name!r} is registered",
        task_name=str(name)[:200],
        task_id=str(id or "")[:64],
        payload=_raw(message),
    )


@task_rejected.connect
def dead_letter_rejected(
    sender: Any = None, message: Any = None, exc: Any = None, **_: Any
) -> None:
    if not runs_this_app(sender):
        return
    dead_letters.record(
        DeadLetter.Reason.REJECTED,
        error=repr(exc) if exc is not None else "message is not a task message",
        task_name=_header(message, "task", 200),
        task_id=_header(message, "id", 64),
        payload=_raw(message),
    )


def dead_letter_undecodable(message: Any, exc: BaseException) -> None:
    dead_letter_message(message, DeadLetter.Reason.REJECTED, f"undecodable message: {exc!r}")
