"""Where a task message may be routed: the project's own task queues, and nowhere else.

Celery routes a task to whatever queue, exchange and routing key its caller names, and creates
a queue it has never heard of. Flower's task API and a periodic task's queue, exchange and
routing key in the admin pass straight through, so a caller could name any Redis key as a
queue: ``send_task(..., queue="unacked")`` pushed a list where kombu keeps its ack hash and
stopped every worker. A message may only be routed to the project's task queues (sweep,
release, maintenance), whoever publishes it:

- at publish time, ``ScreenedAMQP`` (the app's ``amqp`` class) refuses any other destination
  before Celery resolves or creates a queue, for every ``send_task``/``apply_async`` of the
  process: the sweep's fan-out, beat's periodic tasks, the admin's actions, and Flower when it
  runs with the project's app;
- at consumption, the worker's consumer and the Redis transport refuse a message whose
  delivery info names another destination (kombu's restore of an unacknowledged message, and
  Celery's retry, route by it), and the consumer refuses a project task read from any queue
  but its own route's (``misrouting``): the pause stops the release queue only, so a release
  read from the sweep queue would otherwise run while releases are paused.

With quorum queues a retry's route through Celery's native delayed delivery counts as a route
to the task queue its routing key ends in (``cleanup.broker.queues``).

Docs: docs/HARDENING.md, "Routing".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.app.amqp import AMQP
from kombu import Exchange, Queue

from cleanup import wire
from cleanup.broker import queues
from cleanup.broker.celery_app import app
from cleanup.conf import cleanup_settings


class RoutingRefused(ValueError):
    """A task message names a destination other than the project's task queues."""


def task_queues() -> frozenset[str]:
    """The queues task messages may go to (``CLEANUP_SWEEP_QUEUE``, ``CLEANUP_RELEASE_QUEUE``,
    ``CLEANUP_MAINTENANCE_QUEUE``, and the queues of ``CLEANUP_EXTRA_TASK_ROUTES``). The events
    queue takes the outbox's events, never a task."""
    conf = cleanup_settings()
    own = {conf.sweep_queue, conf.release_queue, conf.maintenance_queue}
    return frozenset(own | set(conf.extra_routes().values()))


def task_exchanges() -> frozenset[str]:
    """The exchanges a task message may name: the anonymous one (Celery's default for direct
    routing) and the exchange Celery binds the task queues to (named after the default queue,
    the release queue, unless ``task_default_exchange`` is set)."""
    conf = app.conf
    return frozenset({"", conf.task_default_exchange or conf.task_default_queue})


def _name(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, Exchange | Queue):
        return str(value.name or "")
    return str(value)


def route_problem(exchange: Any, routing_key: Any) -> str | None:
    """Why a task message with this delivery info may not be delivered, or ``None``. With
    quorum queues a retry's countdown goes through Celery's native delayed delivery: published
    to its delayed exchanges, delivered from them, with the delay's binary digits before the
    queue's name in the routing key (``queues.delayed_queue``)."""
    exchange_name = _name(exchange) or ""
    if queues.is_quorum(cleanup_settings()):
        delayed = queues.delayed_queue(exchange_name, routing_key)
        if delayed is not None:
            # Celery's delayed-delivery exchanges lead to the queue named at the key's end.
            exchange_name, routing_key = "", delayed
    if exchange_name not in task_exchanges():
        return f"exchange {exchange_name[:80]!r} is not one the project's task queues are bound to"
    if not isinstance(routing_key, str) or routing_key not in task_queues():
        return (
            f"routing key {str(routing_key)[:80]!r} names none of the project's task queues "
            f"({', '.join(sorted(task_queues()))})"
        )
    return None


def task_queue(name: str) -> str | None:
    """The queue the project's task ``name`` is routed to (``wire.task_routes``, or
    ``CLEANUP_EXTRA_TASK_ROUTES`` for another task of the app), or ``None`` for a task routed
    nowhere (a host project's task goes where its caller sends it, among the task queues)."""
    conf = cleanup_settings()
    extra = conf.extra_routes().get(name)
    if extra is not None:
        return extra
    setting = wire.QUEUE_SETTING.get(name)
    if setting is not None:
        return str(getattr(conf, setting))
    if name.startswith(wire.TASK_PREFIX):
        return conf.maintenance_queue
    return None


def routed_queue(exchange: Any, routing_key: Any) -> str | None:
    """The queue a delivery's exchange and routing key lead to: the routing key, or the queue
    at the end of a delayed-delivery route's key."""
    delayed = queues.delayed_queue(_name(exchange) or "", routing_key)
    if delayed is not None:
        return delayed
    return routing_key if isinstance(routing_key, str) else None


def misrouting(name: str, exchange: Any, routing_key: Any, consumed_from: str | None) -> str | None:
    """Why the project's task ``name`` may not run from this delivery, or ``None``: it was
    routed to, or consumed from, a queue other than its own route's. ``consumed_from`` is the
    queue the worker's consumer read it from, when the broker says (RabbitMQ's consumer tag);
    on Redis the transport has already checked that the routing key is the queue it popped."""
    expected = task_queue(name)
    if expected is None:
        return None
    for what, queue in (
        ("its routing key names", routed_queue(exchange, routing_key)),
        ("it was consumed from", consumed_from),
    ):
        if queue is not None and queue != expected:
            return f"task {name[:200]!r} belongs on queue {expected!r}, but {what} {queue[:80]!r}"
    return None


def is_events_route(exchange: Any, routing_key: Any) -> bool:
    """Whether this is the outbox relay's route: the anonymous exchange to the events queue
    (``CLEANUP_EVENTS_QUEUE``). It takes events, never a task; a worker that consumes it
    (``cleanup.worker.events_consumer``) holds such messages unacknowledged on Redis."""
    return (_name(exchange) or "") == "" and routing_key == cleanup_settings().events_queue


def check_publish(
    name: str, queue: Any = None, exchange: Any = None, routing_key: Any = None
) -> None:
    """Refuse a task publish whose queue, exchange or routing key leaves the project's task
    queues (``RoutingRefused``). Only what the caller asked for is checked: what Celery fills in
    from the routes and defaults is the project's own configuration."""
    queue_name = _name(queue)
    if queue_name is not None and queue_name not in task_queues():
        raise RoutingRefused(
            f"task {name[:200]!r}: queue {queue_name[:80]!r} is not one of the project's task "
            f"queues ({', '.join(sorted(task_queues()))})"
        )
    if isinstance(queue, Queue) and queue.exchange is not None:
        exchange = exchange if exchange is not None else queue.exchange
        routing_key = routing_key if routing_key else (queue.routing_key or queue_name)
    if exchange is None and not routing_key:
        return
    problem = route_problem(exchange, routing_key or queue_name)
    if problem is not None:
        raise RoutingRefused(f"task {name[:200]!r}: {problem}")


# celery-types does not declare AMQP's task-sender factory.
_AMQP: Any = AMQP


class ScreenedAMQP(_AMQP):
    """Celery's AMQP helper with every task publish's destination checked first."""

    def _create_task_sender(self) -> Callable[..., Any]:
        send = super()._create_task_sender()

        def send_task_message(
            producer: Any,
            name: str,
            message: Any,
            exchange: Any = None,
            routing_key: Any = None,
            queue: Any = None,
            **kwargs: Any,
        ) -> Any:
            check_publish(name, queue=queue, exchange=exchange, routing_key=routing_key)
            return send(
                producer,
                name,
                message,
                exchange=exchange,
                routing_key=routing_key,
                queue=queue,
                **kwargs,
            )

        return send_task_message
