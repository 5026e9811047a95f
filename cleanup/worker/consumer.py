"""A worker consumer that turns whatever a single message raises into a dead letter.

Celery's consumer runs a message through decoding, the task registry, the request constructor
and the hand-off to a pool child in the worker's *main* process. An exception anywhere there
stops the worker ("Unrecoverable error"), the message is restored, and it stops the next worker
the same way: one message can take down a fleet. This subclass:

1. screens the message before anything decodes it deeply (``cleanup.broker.screening``): body size,
   JSON nesting, the types of the headers Celery reads, an unknown task name, the body's shape;
2. runs Celery's own handler inside a catch-all, so anything else a single message raises
   (decode errors, ``RecursionError``, ``MemoryError``, a bug) is contained too;
3. records a dead letter with the reason and a bounded copy of the message, then rejects the
   message without requeue (the dead letter row is the copy that is kept).

Only connection-level errors propagate: they restart the consumer, and the broker redelivers.
Set by the ``worker_consumer`` setting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery.concurrency import ALIASES  # type: ignore[attr-defined]  # not in celery-types
from celery.worker.consumer import Consumer
from django.core.exceptions import ImproperlyConfigured
from kombu.exceptions import ContentDisallowed, DecodeError
from vine import promise

from cleanup import metrics
from cleanup.broker import queues, routes, screening, signing
from cleanup.conf import WORKER_POOLS, cleanup_settings
from cleanup.models import DeadLetter
from cleanup.worker.delayed_delivery import CELERY_STEP as CELERY_DELAYED_DELIVERY
from cleanup.worker.signals import dead_letter_message, dead_letter_undecodable

logger = logging.getLogger("cleanup.consumer")

# Every task Celery itself registers (celery.chord_unlock, celery.map, celery.group, …).
BUILTIN_PREFIX = "celery."


# What each pool other than prefork gives up that the pipeline relies on (docs/LIBRARY-NOTES.md,
# "Pools"): the sweep stops cleanly at its soft time limit, the visibility timeout is sized
# against the hard one, and a lost pool process puts back only its own message.
POOL_SHORTFALLS = {
    "threads": "enforces no task time limit, and a crashed thread takes the whole worker",
    "solo": "enforces no task time limit, and runs one task at a time in the main process",
    "gevent": "enforces only the hard time limit, where a greenlet yields",
    "eventlet": "enforces only the hard time limit, where a greenlet yields",
}


# Celery's own table of `--pool` names and the classes they load, read backwards.
_POOL_NAMES = {ALIASES[name]: name for name in WORKER_POOLS}


def pool_name(pool: Any) -> str:
    """The ``--pool`` name of a worker's pool instance (its class's module for a custom one)."""
    cls = type(pool)
    return _POOL_NAMES.get(f"{cls.__module__}:{cls.__qualname__}", cls.__module__)


def refuse_unsafe_pool(pool: Any) -> None:
    """Fail the worker's start under a pool that CLEANUP_WORKER_POOLS does not allow."""
    if pool is None:
        return
    name = pool_name(pool)
    allowed = cleanup_settings().worker_pools
    if name in allowed:
        return
    why = POOL_SHORTFALLS.get(name, "is not one the pipeline was built and tested on")
    raise ImproperlyConfigured(
        f"celery worker --pool {name}: the {name} pool {why}; the release pipeline needs "
        f"prefork (CLEANUP_WORKER_POOLS={','.join(allowed)})"
    )


# celery-types does not declare the consumer's runtime attributes (strategies, errors).
_Consumer: Any = Consumer


def drop_malformed_trace_headers(headers: dict[str, Any]) -> list[str]:
    """Trace context is never trusted: a malformed ``traceparent``/``tracestate`` is removed
    from a task message's headers before Celery reads them, and counted
    (``reservation_cleanup_trace_headers_dropped_total``); the message itself goes on."""
    dropped = screening.drop_malformed_trace_headers(headers)
    for name in dropped:
        metrics.record_trace_header_dropped(name)
    return dropped


class DeadLetteringConsumer(_Consumer):
    class Blueprint(_Consumer.Blueprint):  # type: ignore[misc,name-defined]
        # Remote control runs the screened pidbox (cleanup.worker.remote_control); quorum
        # queues' delayed delivery is set up through the node the consumer reached
        # (cleanup.worker.delayed_delivery).
        default_steps = [
            {
                "celery.worker.consumer.control:Control": (
                    "cleanup.worker.remote_control:ScreenedControl"
                ),
                CELERY_DELAYED_DELIVERY: "cleanup.worker.delayed_delivery:NodeDelayedDelivery",
            }.get(step, step)
            for step in Consumer.Blueprint.default_steps
        ]

    def __init__(self, *args: Any, worker_options: Any = None, **kwargs: Any) -> None:
        refuse_unsafe_pool(kwargs.get("pool"))
        screening.refuse_untrusted_decoding()
        # Gossip and mingle are always off, whatever the command line says: both consume
        # broadcasts from every other worker (and from anyone who can write to the broker) in
        # the main process, with handlers that raise on a malformed body, and the pipeline
        # uses neither (no leader elections among workers, no revoked-set sync).
        options = {**(worker_options or {}), "without_gossip": True, "without_mingle": True}
        super().__init__(*args, worker_options=options, **kwargs)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        try:
            dead_letter_undecodable(message, exc)
        finally:
            super().on_decode_error(message, exc)

    def _dead_letter(self, message: Any, reason: str, error: str) -> None:
        """Dead-letter and reject one message; never raises but for the connection."""
        logger.error(
            "message dead-lettered before reaching a task", extra={"reason": reason, "error": error}
        )
        dead_letter_message(message, reason, error)
        if not message.acknowledged:
            message.reject_log_error(logger, self.connection_errors)  # type: ignore[attr-defined]

    def _consumed_from(self, info: dict[str, Any]) -> str | None:
        """The queue the task consumer read a delivery from, by the consumer tag the broker
        put in it (RabbitMQ); ``None`` when there is none (kombu's Redis transport) or the
        queue has been cancelled since."""
        tag = info.get("consumer_tag")
        consumer = getattr(self, "task_consumer", None)
        if tag is None or consumer is None:
            return None
        active: dict[str, Any] = getattr(consumer, "_active_tags", {}) or {}
        for queue, queue_tag in active.items():
            if queue_tag == tag:
                return str(queue)
        return None

    def _screen(self, message: Any) -> tuple[str, str] | None:
        """(reason, error) when the message must not go on to Celery's handler."""
        problem = screening.check_raw(message.body)
        if problem:
            return DeadLetter.Reason.REJECTED, problem
        headers = message.headers
        if not isinstance(headers, dict) or "task" not in headers:
            # Celery would read such a body as protocol 1 (task name, id and limits in the
            # body), where none of the header checks below look: a protocol-1 built-in task or
            # an odd time limit would pass. The project only publishes protocol 2.
            return (
                DeadLetter.Reason.REJECTED,
                "message is not a task message: no 'task' header "
                "(only Celery's message protocol 2 is accepted)",
            )
        drop_malformed_trace_headers(headers)
        name = headers["task"]
        if not isinstance(name, str):
            return DeadLetter.Reason.REJECTED, "header 'task' must be a string"
        if name not in self.strategies:
            # Handled here: Celery's unknown-task path decodes the body again and raises when
            # it cannot (no 'id' header plus an undecodable body stopped the worker).
            return DeadLetter.Reason.UNKNOWN_TASK, f"no task named {name[:200]!r} is registered"
        if name.startswith(BUILTIN_PREFIX):
            # Registered in every app, so the check above passes them: chord_unlock retries
            # forever without a result backend; map/starmap/chunks/group call project tasks
            # from inside a built-in one, around CleanupTask's delivery guard.
            return (
                DeadLetter.Reason.REJECTED,
                f"Celery's built-in task {name[:200]!r} is not accepted on the project's queues",
            )
        problem = screening.check_headers(headers)
        if problem:
            return DeadLetter.Reason.REJECTED, problem
        info = message.delivery_info or {}
        problem = routes.route_problem(info.get("exchange"), info.get("routing_key"))
        if problem:
            # kombu's restore and Celery's retry would send it on to wherever it names.
            return DeadLetter.Reason.MISROUTED, f"misrouted: {problem}"
        problem = routes.misrouting(
            name, info.get("exchange"), info.get("routing_key"), self._consumed_from(info)
        )
        if problem:
            # Each queue is paused, scaled and drained for its own tasks: a release read from
            # the sweep queue would run while releases are paused.
            return DeadLetter.Reason.MISROUTED, f"misrouted: {problem}"
        problem = screening.check_content(message.content_type, message.content_encoding)
        if problem:
            return DeadLetter.Reason.REJECTED, problem
        try:
            payload = message.payload  # decoded once; kombu caches it for the request
        except (DecodeError, ContentDisallowed) as exc:
            return DeadLetter.Reason.REJECTED, f"undecodable message: {exc!r}"[:2000]
        problem = (
            screening.check_payload(payload)
            or screening.check_body_size(len(message.body), payload)
            or screening.check_publish_options(
                headers,
                payload[2],
                time_limits=(self.app.conf.task_time_limit, self.app.conf.task_soft_time_limit),
                eta_bound_seconds=cleanup_settings().retry_backoff_max,
                now=datetime.now(UTC),
                broker_headers=queues.broker_headers(cleanup_settings()),
            )
        )
        if problem:
            return DeadLetter.Reason.REJECTED, problem
        problem = signing.problem(headers, name, payload[0], payload[1])
        if problem:
            # Never run and never counted: the letter names no hold (a broker writer chose
            # the hold), only the message's raw copy.
            return DeadLetter.Reason.UNSIGNED, problem
        return None

    def create_task_handler(self, promise: Any = promise) -> Callable[[Any], Any]:
        handler = super().create_task_handler(promise)
        fatal = tuple(self.connection_errors) + tuple(self.channel_errors)

        def on_task_received(message: Any) -> Any:
            try:
                problem = self._screen(message)
                if problem is None:
                    return handler(message)
                self._dead_letter(message, *problem)
            except fatal:
                raise
            except Exception as exc:  # one message must never stop the worker
                # No known message reaches this line since protocol-1 bodies are refused in
                # _screen (they did: docs/TESTING.md); it stays as the last line of defence.
                logger.error("message raised before reaching a task", exc_info=True)
                try:
                    self._dead_letter(message, DeadLetter.Reason.REJECTED, repr(exc)[:2000])
                except fatal:
                    raise
                except Exception:
                    logger.exception("could not set the message aside")
            return None

        return on_task_received
