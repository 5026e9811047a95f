"""Where a task message may be routed (cleanup.broker.routes): a task sent anywhere but the
project's own queues is refused before anything is published, the project's own publishes
pass, and a retry goes through native delayed delivery only with quorum queues."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from celery.exceptions import QueueNotFound
from django.core.exceptions import ImproperlyConfigured
from kombu import Exchange, Queue
from kombu.transport.native_delayed_delivery import calculate_routing_key, level_name

from cleanup import wire
from cleanup.broker import celery_policy, queues, routes
from cleanup.conf import CleanupSettings, cleanup_settings
from cleanup.release.messages import ReleaseMessage
from cleanup.release.publish import publish_release_messages
from config.celery_app import app
from tests.support.planted import QUEUE, redis_only


def _utc_now() -> Any:
    return datetime.now(UTC)


def as_options(queue: Queue) -> dict[str, Any]:
    """``send_task``'s ``queue`` takes a queue object too (celery-types declares a name only)."""
    return {"queue": queue}


@redis_only
@pytest.mark.parametrize(
    "options",
    [
        {"queue": "unacked"},
        {"routing_key": "unacked"},
        {"exchange": "", "routing_key": "unacked_index"},
        {"queue": QUEUE, "routing_key": "_kombu.binding.cleanup"},
        {"exchange": "celery.pidbox"},
        {"queue": cleanup_settings().events_queue},
    ],
    ids=[
        "queue",
        "routing key",
        "anonymous exchange",
        "queue and routing key",
        "exchange",
        "events",
    ],
)
def test_a_task_routed_anywhere_but_the_projects_queues_is_refused_before_publishing(
    broker: redis.Redis, options: dict[str, Any]
) -> None:
    # when: a caller (Flower's API, a periodic task's options) names another destination
    with pytest.raises((routes.RoutingRefused, QueueNotFound)):
        app.send_task("cleanup.release_reservation", args=({},), **options)
    # then: nothing was written anywhere
    assert [k for k in broker.scan_iter() if not k.startswith(b"_kombu")] == []


@redis_only
@pytest.mark.parametrize(
    "queue",
    [
        Queue(QUEUE, exchange=Exchange("somewhere-else"), routing_key=QUEUE),
        Queue(QUEUE, exchange=Exchange("somewhere-else")),
        Queue(
            QUEUE,
            exchange=Exchange(app.conf.task_default_exchange or app.conf.task_default_queue),
            routing_key="unacked",
        ),
    ],
    ids=["foreign exchange", "foreign exchange, no routing key", "foreign routing key"],
)
def test_a_queue_object_named_like_a_task_queue_but_routed_elsewhere_is_refused(
    broker: redis.Redis, queue: Queue
) -> None:
    # when: a caller passes a queue object that has a task queue's name but its own exchange or
    # routing key (the message would be delivered by those, not by the name)
    with pytest.raises(routes.RoutingRefused):
        app.send_task("cleanup.release_reservation", args=({},), **as_options(queue))
    # then: nothing was written anywhere, not even a binding to the foreign exchange
    assert list(broker.scan_iter()) == []


@redis_only
def test_the_projects_own_queue_object_passes_the_routing_check(broker: redis.Redis) -> None:
    app.send_task("cleanup.release_reservation", args=({},), **as_options(app.amqp.queues[QUEUE]))
    assert broker.llen(QUEUE) == 1


@redis_only
def test_the_projects_own_publishes_pass_the_routing_check(broker: redis.Redis) -> None:
    app.send_task("cleanup.prune")
    app.send_task("cleanup.sweep_shard", kwargs={"shard": 0, "shards": 1})
    publish_release_messages([ReleaseMessage.for_hold(1, 1, _utc_now(), 0, "t")])
    assert broker.llen(QUEUE) == 1 and broker.llen(cleanup_settings().sweep_queue) == 1


def test_a_retry_through_native_delayed_delivery_is_routed_only_with_quorum_queues(
    settings: Any,
) -> None:
    delayed_key = calculate_routing_key(3, "cleanup")
    published_to, delivered_from = level_name(27), "celery_delayed_delivery"
    settings.CLEANUP_RABBITMQ_QUEUE_TYPE = "quorum"
    assert routes.route_problem(published_to, delayed_key) is None
    assert routes.route_problem(delivered_from, delayed_key) is None
    assert routes.route_problem(level_name(4), delayed_key) is None  # left from a lower level
    routes.check_publish(wire.RELEASE_TASK, exchange=published_to, routing_key=delayed_key)
    # the delay's digits lead only to the project's own queues, through Celery's exchanges only
    assert "names none of the project's task queues" in str(
        routes.route_problem(published_to, calculate_routing_key(3, "unacked"))
    )
    assert "is not one the project's task queues" in str(
        routes.route_problem("amq.topic", delayed_key)
    )
    assert routes.route_problem(published_to, "1.0.cleanup") is not None  # not 28 digits
    settings.CLEANUP_RABBITMQ_QUEUE_TYPE = "classic"
    assert routes.route_problem(published_to, delayed_key) is not None


def test_a_project_task_belongs_on_its_own_route_only() -> None:
    conf = cleanup_settings()
    release = "cleanup.release_reservation"
    assert routes.task_queue(release) == conf.release_queue
    assert routes.task_queue("cleanup.sweep_shard") == conf.sweep_queue
    assert routes.task_queue("billing.on_event") is None  # a host's task goes where it is sent
    assert routes.misrouting(release, "", conf.release_queue, conf.release_queue) is None
    assert "belongs on queue" in str(routes.misrouting(release, "", conf.sweep_queue, None))
    # a routing key can be forged by a binding; the queue the consumer read it from cannot
    assert "consumed from" in str(
        routes.misrouting(release, "", conf.release_queue, conf.maintenance_queue)
    )
    assert routes.misrouting("billing.on_event", "", conf.sweep_queue, None) is None


EXTRA = ["bench.noop=bench", "bench.wait=bench"]


def test_another_task_of_the_app_gets_its_queue_only_by_a_declared_route(settings: Any) -> None:
    # given: no extra route, a queue of one's own is refused as before
    with pytest.raises(routes.RoutingRefused):
        routes.check_publish("bench.noop", queue="bench")
    # when: the task and its queue are declared (CLEANUP_EXTRA_TASK_ROUTES)
    settings.CLEANUP_EXTRA_TASK_ROUTES = EXTRA
    conf = cleanup_settings()
    # then: the queue is a task queue, declared and routed like the project's
    assert "bench" in routes.task_queues()
    routes.check_publish("bench.noop", queue="bench")
    assert routes.route_problem("", "bench") is None
    assert [q.name for q in queues.task_queues(conf)][-1] == "bench"
    policy = celery_policy.policy(conf, "redis://127.0.0.1:6379/0")
    assert policy["task_routes"]["bench.noop"] == {"queue": "bench"}
    assert policy["task_create_missing_queues"] is False
    # and each such task runs only from its own queue
    assert routes.task_queue("bench.wait") == "bench"
    assert routes.misrouting("bench.noop", "", "bench", "bench") is None
    assert "belongs on queue 'bench'" in str(
        routes.misrouting("bench.noop", "", conf.maintenance_queue, None)
    )
    assert "belongs on queue" in str(routes.misrouting(wire.RELEASE_TASK, "", "bench", None))
    # and every other destination stays refused
    with pytest.raises(routes.RoutingRefused):
        routes.check_publish("bench.noop", queue="unacked")


@pytest.mark.parametrize(
    ("pair", "says"),
    [
        ("bench.noop", "expected 'task=queue'"),
        ("=bench", "expected 'task=queue'"),
        ("bench.noop=", "expected 'task=queue'"),
        ("cleanup.prune=bench", "are the project's"),
        ("bench.noop=cleanup", "one of the project's own"),
        ("bench.noop=reservation-events", "one of the project's own"),
        ("bench.noop=unacked", "kombu keeps its own bookkeeping"),
        ("bench.noop=_kombu.binding.cleanup", "kombu keeps its own bookkeeping"),
        ("bench.noop=be nch", "no space"),
        ("bench.noop=bench.#", "no space, * or #"),
    ],
)
def test_an_extra_route_that_could_reach_the_projects_keys_is_refused(pair: str, says: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=re.escape(says)):
        CleanupSettings(extra_task_routes=(pair,))


def test_an_extra_route_names_each_task_once() -> None:
    with pytest.raises(ImproperlyConfigured, match="names a task twice"):
        CleanupSettings(extra_task_routes=("bench.noop=a", "bench.noop=b"))
