"""The project's queues as RabbitMQ declares them: classic, or replicated quorum queues
(``CLEANUP_RABBITMQ_QUEUE_TYPE``), and what a quorum queue changes on the way.

Classic (the default) declares the task queues exactly as before: on Celery's default direct
exchange (named after the release queue), no arguments. Quorum declares each queue of the
project (sweep, release, maintenance, and the outbox's events queue) with
``x-queue-type: quorum``, and the task queues also with ``x-delivery-limit``:

- **Delivery limit.** A quorum queue counts the deliveries of each message itself and drops one
  returned more than ``x-delivery-limit`` times. The project's own cap
  (``CLEANUP_MAX_DELIVERIES``, which writes a dead letter with its reason) must act first, so
  the broker's limit is a fixed backstop above it, ``QUORUM_DELIVERY_LIMIT``: RabbitMQ refuses
  to redeclare a queue with another limit, so it cannot follow the setting.
- **The broker's delivery count.** A redelivery from a quorum queue carries the broker's own
  count in the ``x-delivery-count`` header (``broker_delivery_count``), which the delivery
  policy uses instead of a counter round trip.
- **Native delayed delivery.** Celery turns global QoS off for quorum queues (they do not
  support it), so a retry's eta message held in a worker's memory would take its prefetch slot
  until it is due. Celery sends a retry with a countdown through its delayed-delivery exchanges
  instead (``celery_delayed_27`` down to ``celery_delayed_delivery``, routing keys of 28 binary
  digits before the queue's own), which work only for a topic exchange: the task queues are
  bound to one, ``<release queue>.topic``. ``delayed_queue`` reads which task queue such a
  route leads to, so that the routing checks (``cleanup.broker.routes``) accept it.
- **Headers the broker adds.** ``BROKER_HEADERS`` (the delivery count, and the ``x-death``
  record of the delayed-delivery queues a retry passed through) are accepted on a task message
  only from quorum queues.
- **Priorities.** RabbitMQ 3.x quorum queues have no ``x-max-priority``; the project sets no
  message priority and declares none, and a queue that asks for one is refused at start-up.

RabbitMQ refuses to redeclare an existing queue as another type (PRECONDITION_FAILED): a worker
declares the queues before it starts and refuses to start naming the setting and the queue
(``declaration_refusals``); docs/TOPOLOGIES.md, "RabbitMQ cluster", says how to migrate.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from kombu import Exchange, Queue

# The broker's backstop: well above CLEANUP_MAX_DELIVERIES' default (8), fixed because RabbitMQ
# refuses to redeclare a queue whose limit changed; cleanup.conf refuses a cap at or above it.
from cleanup.conf import QUORUM_DELIVERY_LIMIT, CleanupSettings

SETTING = "CLEANUP_RABBITMQ_QUEUE_TYPE"
# The exchange the task queues are bound to with quorum queues: native delayed delivery needs a
# topic exchange (the direct one classic queues use keeps its name and type).
TOPIC_EXCHANGE_SUFFIX = ".topic"
# Headers RabbitMQ itself writes on a message from a quorum queue: its delivery count on a
# redelivery, and the dead-lettering record of the delayed-delivery queues a retry waited in.
BROKER_HEADERS = frozenset(
    {
        "x-delivery-count",
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
# kombu.transport.native_delayed_delivery: the exchanges a delayed message is published to
# (level 27), passes through (levels 26..0) and leaves by, and its routing key: 28 binary
# digits, each followed by a dot, then the destination's routing key.
DELAYED_EXCHANGE = re.compile(r"celery_delayed_(?:[0-9]|1[0-9]|2[0-7]|delivery)")
DELAYED_ROUTING_KEY = re.compile(r"(?:[01]\.){28}(?P<queue>.+)")


def is_quorum(conf: CleanupSettings) -> bool:
    return conf.rabbitmq_queue_type == "quorum"


def task_exchange_name(conf: CleanupSettings) -> str:
    """The exchange the task queues are bound to (Celery's ``task_default_exchange``)."""
    return conf.release_queue + (TOPIC_EXCHANGE_SUFFIX if is_quorum(conf) else "")


def task_exchange_type(conf: CleanupSettings) -> str:
    return "topic" if is_quorum(conf) else "direct"


def task_queue_arguments(conf: CleanupSettings) -> dict[str, Any] | None:
    """The arguments every task queue is declared with (None: a classic queue, none)."""
    if not is_quorum(conf):
        return None
    return {"x-queue-type": "quorum", "x-delivery-limit": QUORUM_DELIVERY_LIMIT}


def task_queues(conf: CleanupSettings) -> list[Queue]:
    """Celery's ``task_queues``: sweep, release and maintenance, then the queues of
    ``CLEANUP_EXTRA_TASK_ROUTES``, each bound by its own name."""
    extra = sorted(set(conf.extra_routes().values()))
    names = (conf.sweep_queue, conf.release_queue, conf.maintenance_queue, *extra)
    if not is_quorum(conf):
        # Celery binds them to its default (direct) exchange, as it always has.
        return [Queue(name, routing_key=name) for name in names]
    exchange = Exchange(task_exchange_name(conf), type="topic")
    queues = [
        Queue(name, exchange, routing_key=name, queue_arguments=task_queue_arguments(conf))
        for name in names
    ]
    for name in names:
        if "*" in name or "#" in name:
            # A topic binding would read them as wildcards and route other keys here.
            raise ImproperlyConfigured(f"{SETTING}=quorum: queue name {name!r} has a * or # in it")
    check_priorities(conf, queues)
    return queues


def events_queue(conf: CleanupSettings) -> Queue:
    """The outbox relay's queue (on the anonymous exchange): quorum too when the setting says so;
    its consumers are other systems, so the broker sets no delivery limit on it."""
    return Queue(
        conf.events_queue,
        exchange=Exchange(""),
        routing_key=conf.events_queue,
        durable=True,
        queue_arguments={"x-queue-type": "quorum"} if is_quorum(conf) else None,
    )


def check_priorities(
    conf: CleanupSettings, queues: Iterable[Queue], max_priority: int | None = None
) -> None:
    """Refuse quorum queues with priorities (RabbitMQ 3.x has none on quorum queues): a queue
    declared with ``x-max-priority``, or Celery's ``task_queue_max_priority``."""
    if not is_quorum(conf):
        return
    asked = [q.name for q in queues if "x-max-priority" in (q.queue_arguments or {})]
    if max_priority is not None:
        asked.append("task_queue_max_priority")
    if asked:
        raise ImproperlyConfigured(
            f"{SETTING}=quorum: quorum queues have no priorities, but {', '.join(asked)} asks "
            f"for them (x-max-priority); use classic queues or drop the priorities"
        )


def broker_headers(conf: CleanupSettings) -> frozenset[str]:
    """The headers RabbitMQ adds that a task message may carry: ``BROKER_HEADERS`` from quorum
    queues, none from classic ones."""
    return BROKER_HEADERS if is_quorum(conf) else frozenset()


def delayed_queue(exchange: str, routing_key: Any) -> str | None:
    """The queue a native delayed-delivery route leads to (its routing key without the delay
    digits), or None when ``exchange`` and ``routing_key`` are not such a route."""
    if not DELAYED_EXCHANGE.fullmatch(exchange) or not isinstance(routing_key, str):
        return None
    found = DELAYED_ROUTING_KEY.fullmatch(routing_key)
    return found.group("queue") if found else None


def broker_delivery_count(headers: Mapping[str, Any] | None, redelivered: bool) -> int | None:
    """The broker's count of this message's earlier deliveries (RabbitMQ's ``x-delivery-count``
    on a redelivery from a quorum queue), or None. Only a redelivery's header is the broker's
    word: RabbitMQ sets it then, over whatever a publisher wrote; on a first delivery the header
    would be the publisher's, and is ignored."""
    if not redelivered or not headers:
        return None
    value = headers.get("x-delivery-count")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        # A redelivery has been delivered before: 0 (or none) is not a count this can use, and
        # the caller counts the redelivery itself.
        return None
    return value


def declaration_refusals(channel: Any, queues: Iterable[Queue], queue_type: str) -> list[str]:
    """Declare ``queues`` on ``channel`` (each on a fresh channel after a refusal: a refused
    declare closes the channel) and describe each one RabbitMQ refuses because it exists with
    other arguments (PRECONDITION_FAILED: another type, or another delivery limit)."""
    from amqp.exceptions import PreconditionFailed  # noqa: PLC0415 - py-amqp only with RabbitMQ

    refusals = []
    for queue in queues:
        try:
            queue.bind(channel).declare()
        except PreconditionFailed as exc:
            refusals.append(
                f"{SETTING}={queue_type}: RabbitMQ refuses to declare queue {queue.name!r} as "
                f"this worker does ({queue_kind(queue)}), because it exists with other "
                f"arguments ({str(getattr(exc, 'reply_text', exc))[:300]}); a queue's type "
                f"cannot change: drain and delete it, or use a new vhost (docs/TOPOLOGIES.md, "
                f"'RabbitMQ cluster')"
            )
            channel = channel.connection.channel()
    return refusals


def queue_kind(queue: Queue) -> str:
    arguments = queue.queue_arguments or {}
    kind = str(arguments.get("x-queue-type", "classic"))
    limit = arguments.get("x-delivery-limit")
    return f"{kind}, x-delivery-limit {limit}" if limit is not None else kind
