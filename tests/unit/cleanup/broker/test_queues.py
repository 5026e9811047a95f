"""RabbitMQ's queue types (cleanup.broker.queues, CLEANUP_RABBITMQ_QUEUE_TYPE): the declarations
of both types, the settings that go with quorum queues and the ones refused, Celery's per-consumer
QoS with them, the routes of native delayed delivery, the broker's own delivery count, and a
cluster URL's failover keeping the screened transport. The queues on a real cluster:
tests/integration/test_rabbitmq_cluster.py."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from amqp.exceptions import PreconditionFailed
from celery.utils.quorum_queues import detect_quorum_queues
from celery.worker.consumer.tasks import Tasks
from django.core.exceptions import ImproperlyConfigured
from kombu import Connection, Queue
from kombu.transport.native_delayed_delivery import calculate_routing_key, level_name

from cleanup import wire
from cleanup.broker import queues, routes, screening
from cleanup.conf import QUORUM_DELIVERY_LIMIT, CleanupSettings
from cleanup.release import delivery_cap
from cleanup.release.messages import build
from cleanup.worker import amqp_transport
from tests.support.child_python import run_with

CLASSIC = CleanupSettings()
QUORUM = CleanupSettings(rabbitmq_queue_type="quorum")
AMQP = "amqp://guest:guest@127.0.0.1:5672/quorum_unit"


def test_classic_queues_are_declared_as_before_on_celerys_default_exchange() -> None:
    declared = queues.task_queues(CLASSIC)
    # no exchange of their own: Celery binds them to its default one
    assert [(q.name, q.routing_key, q.exchange.name, q.queue_arguments) for q in declared] == [
        ("sweep", "sweep", "", None),
        ("cleanup", "cleanup", "", None),
        ("maintenance", "maintenance", "", None),
    ]
    assert queues.events_queue(CLASSIC).queue_arguments is None
    assert (queues.task_exchange_name(CLASSIC), queues.task_exchange_type(CLASSIC)) == (
        "cleanup",
        "direct",
    )


def test_quorum_queues_carry_the_type_and_a_delivery_limit_above_the_projects_cap() -> None:
    declared = queues.task_queues(QUORUM)
    assert [q.name for q in declared] == ["sweep", "cleanup", "maintenance"]
    for queue in declared:
        assert queue.queue_arguments == {
            "x-queue-type": "quorum",
            "x-delivery-limit": QUORUM_DELIVERY_LIMIT,
        }
        # a topic exchange: Celery's native delayed delivery binds to it with "#.<queue>"
        assert (queue.exchange.name, queue.exchange.type) == ("cleanup.topic", "topic")
        assert queue.routing_key == queue.name
    assert QUORUM_DELIVERY_LIMIT > QUORUM.max_deliveries
    # the outbox's events queue is quorum too; its consumers are other systems: no limit
    assert queues.events_queue(QUORUM).queue_arguments == {"x-queue-type": "quorum"}


def test_priorities_and_a_wildcard_queue_name_are_refused_with_quorum_queues() -> None:
    prioritised = Queue("cleanup", queue_arguments={"x-max-priority": 9})
    queues.check_priorities(CLASSIC, [prioritised], max_priority=9)  # classic: fine
    with pytest.raises(ImproperlyConfigured, match="CLEANUP_RABBITMQ_QUEUE_TYPE=quorum: quorum"):
        queues.check_priorities(QUORUM, [prioritised])
    with pytest.raises(ImproperlyConfigured, match="task_queue_max_priority"):
        queues.check_priorities(QUORUM, queues.task_queues(QUORUM), max_priority=9)
    with pytest.raises(ImproperlyConfigured, match=r"'cleanup\.#' has a \* or #"):
        queues.task_queues(dataclasses.replace(QUORUM, release_queue="cleanup.#"))


SETTINGS = (
    "import django, json; django.setup(); from django.conf import settings as s; "
    "from config.celery_app import app; "
    "print(json.dumps([s.CELERY_BROKER_TRANSPORT, app.conf.task_default_exchange, "
    "app.conf.task_default_exchange_type, app.conf.worker_detect_quorum_queues, "
    "{n: [q.exchange.name, q.exchange.type, q.queue_arguments] "
    "for n, q in app.amqp.queues.items()}]))"
)


def test_quorum_settings_declare_every_task_queue_quorum_on_the_topic_exchange() -> None:
    url = "amqp://guest:guest@n1:5672/v;amqp://guest:guest@n2:5672/v;amqp://guest:guest@n3/v"
    out = run_with(SETTINGS, CELERY_BROKER_URL=url, CLEANUP_RABBITMQ_QUEUE_TYPE="quorum")
    assert out.returncode == 0, out.stderr[-800:]
    transport, exchange, kind, detect, declared = json.loads(out.stdout.splitlines()[-1])
    # a cluster's URL list is accepted, on the screened transport
    assert transport == "cleanup.worker.amqp_transport:Transport"
    assert (exchange, kind, detect) == ("cleanup.topic", "topic", True)
    limit = {"x-queue-type": "quorum", "x-delivery-limit": QUORUM_DELIVERY_LIMIT}
    assert declared == {
        n: ["cleanup.topic", "topic", limit] for n in ("sweep", "cleanup", "maintenance")
    }


def test_the_default_settings_keep_classic_queues_on_the_direct_exchange() -> None:
    out = run_with(SETTINGS, CELERY_BROKER_URL=AMQP)
    assert out.returncode == 0, out.stderr[-800:]
    _, exchange, kind, _, declared = json.loads(out.stdout.splitlines()[-1])
    assert (exchange, kind) == ("cleanup", "direct")
    assert declared == {n: ["cleanup", "direct", None] for n in ("sweep", "cleanup", "maintenance")}


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {"CLEANUP_RABBITMQ_QUEUE_TYPE": "quorum"},  # the tests' Redis broker
            "CLEANUP_RABBITMQ_QUEUE_TYPE=quorum needs a RabbitMQ broker",
        ),
        (
            {"CLEANUP_RABBITMQ_QUEUE_TYPE": "lazy", "CELERY_BROKER_URL": AMQP},
            "CLEANUP_RABBITMQ_QUEUE_TYPE='lazy': expected one of 'classic', 'quorum'",
        ),
        (
            {"CELERY_BROKER_URL": AMQP + ";amqps://guest:guest@n2:5671/quorum_unit"},
            "CELERY_BROKER_URL: every entry of a RabbitMQ URL list must have the same scheme",
        ),
    ],
)
def test_start_up_refuses_a_queue_type_combination_naming_the_variable(
    env: dict[str, str], words: str
) -> None:
    out = run_with("import django; django.setup()", **env)
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]


def _consumer(app_queues: list[Queue]) -> Any:
    """What Celery's Tasks bootstep reads to choose its QoS mode."""
    amqp = SimpleNamespace(queues={q.name: q for q in app_queues})
    app = SimpleNamespace(amqp=amqp, conf=SimpleNamespace(worker_detect_quorum_queues=True))
    connection = SimpleNamespace(
        qos_semantics_matches_spec=False, transport=SimpleNamespace(driver_type="amqp")
    )
    return SimpleNamespace(app=app, connection=connection)


def test_celery_detects_the_quorum_declarations_and_turns_global_qos_off() -> None:
    quorum, classic = _consumer(queues.task_queues(QUORUM)), _consumer(queues.task_queues(CLASSIC))
    assert detect_quorum_queues(quorum.app, "amqp") == (True, "sweep")
    assert detect_quorum_queues(classic.app, "amqp") == (False, "")
    bootstep = Tasks.__new__(Tasks)
    # per consumer: each consumer's prefetch (multiplier x pool processes) is its own
    assert bootstep.qos_global(quorum) is False
    assert bootstep.qos_global(classic) is True


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


def test_the_headers_rabbitmq_adds_are_accepted_only_from_quorum_queues() -> None:
    headers = {"id": "t1", "task": wire.RELEASE_TASK, "x-delivery-count": 2, "x-death": []}
    check = dict(time_limits=(30.0, 25.0), eta_bound_seconds=30.0, now=None)
    refused = screening.check_publish_options(headers, None, **check)  # type: ignore[arg-type]
    assert "is not one the project's publisher sets" in str(refused)
    broker = queues.broker_headers(QUORUM)
    assert screening.check_publish_options(headers, None, broker_headers=broker, **check) is None  # type: ignore[arg-type]
    assert queues.broker_headers(CLASSIC) == frozenset()


@pytest.mark.parametrize(
    ("headers", "redelivered", "count"),
    [
        ({"x-delivery-count": 3}, True, 3),
        ({"x-delivery-count": 3}, False, None),  # a first delivery: the publisher's header
        ({}, True, None),
        ({"x-delivery-count": 0}, True, None),  # a redelivery was delivered before
        ({"x-delivery-count": True}, True, None),
        ({"x-delivery-count": "3"}, True, None),
    ],
)
def test_the_brokers_delivery_count_is_read_only_from_a_redelivery(
    headers: dict[str, Any], redelivered: bool, count: int | None
) -> None:
    assert queues.broker_delivery_count(headers, redelivered) == count


@pytest.fixture
def counter_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def increment(key: str) -> int:
        calls.append(f"increment {key}")
        return 10

    def current(key: str) -> int:
        calls.append(f"current {key}")
        return 2

    monkeypatch.setattr(delivery_cap, "increment", increment)
    monkeypatch.setattr(delivery_cap, "current", current)
    return calls


def _count(task: Any, retries: int, **headers: Any) -> int:
    message = build(41, 1, datetime(2026, 1, 1, tzinfo=UTC), 0, "trace")
    task.push_request(
        id="t1", retries=retries, delivery_info={"redelivered": True}, called_directly=False,
        **headers,
    )  # fmt: skip
    try:
        return int(task.count_delivery((message,), {}))
    finally:
        task.pop_request()


def test_a_quorum_redelivery_is_counted_by_the_broker_without_a_round_trip(
    settings: Any, counter_calls: list[str]
) -> None:
    from cleanup.tasks import release_reservation_task as task

    settings.BROKER_IS_REDIS = False  # RabbitMQ: a redelivery is counted where it arrives
    settings.CLEANUP_RABBITMQ_QUEUE_TYPE = "quorum"
    headers = {"x-delivery-count": 3}
    # the broker's 3 earlier deliveries, and this one
    assert _count(task, 0, **headers) == 4
    assert counter_calls == []
    # a retry's redelivery: the retries counted under its key (2) + the broker's 3 + this one
    assert _count(task, 1, **headers) == 6
    assert counter_calls == ["current release:41:1"]
    # without the broker's header (or on classic queues) the redelivery is counted as before
    counter_calls.clear()
    assert _count(task, 0) == 11
    settings.CLEANUP_RABBITMQ_QUEUE_TYPE = "classic"
    assert _count(task, 0, **headers) == 11
    assert counter_calls == ["increment release:41:1", "increment release:41:1"]


class _Channel:
    """A channel whose declares RabbitMQ refuses for the queues named in ``refused``."""

    channel_id = 1

    def __init__(self, refused: set[str]) -> None:
        self.refused = refused
        self.declared: list[str] = []
        self.connection = SimpleNamespace(channel=lambda: self)

    def queue_declare(self, queue: str, **_: Any) -> Any:
        if queue in self.refused:
            raise PreconditionFailed(
                f"PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue '{queue}'"
            )
        self.declared.append(queue)
        return (queue, 0, 0)

    def prepare_queue_arguments(self, arguments: Any, **_: Any) -> Any:
        return arguments

    def exchange_declare(self, *_: Any, **__: Any) -> None:
        pass

    def queue_bind(self, *_: Any, **__: Any) -> None:
        pass


def test_a_queue_of_another_type_is_refused_naming_the_setting_and_the_queue() -> None:
    channel = _Channel(refused={"cleanup"})
    refusals = queues.declaration_refusals(channel, queues.task_queues(QUORUM), "quorum")
    assert channel.declared == ["sweep", "maintenance"]
    assert len(refusals) == 1
    assert refusals[0].startswith(
        "CLEANUP_RABBITMQ_QUEUE_TYPE=quorum: RabbitMQ refuses to declare queue 'cleanup' as "
        "this worker does (quorum, x-delivery-limit 100), because it exists with other arguments"
    )
    assert "drain and delete it, or use a new vhost" in refusals[0]


@pytest.mark.parametrize(
    ("url", "transport"),
    [
        ("amqp://guest:guest@127.0.0.1:1//;amqp://guest:guest@127.0.0.1:2//", "Transport"),
        ("amqps://guest:guest@127.0.0.1:1//;amqps://guest:guest@127.0.0.1:2//", "SSLTransport"),
    ],
)
def test_a_failed_connection_switching_to_the_next_node_keeps_the_screened_transport(
    url: str, transport: str
) -> None:
    # given: a broker connection over two nodes, as Celery makes it from the settings
    conn = Connection(url, transport=f"cleanup.worker.amqp_transport:{transport}")
    # when: kombu switches to the next URL, as it does after a failed connection attempt
    conn.maybe_switch_next()
    # then: the URL's scheme selects the project's transport, not kombu's unscreened one
    assert conn.port == 2
    assert type(conn.transport) is getattr(amqp_transport, transport)


def test_a_worker_refuses_to_start_with_priorities_on_quorum_queues(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import current_app

    from cleanup.worker.signals import refuse_queues_of_another_type

    # given: a RabbitMQ connection (never opened: the refusal comes first) and quorum queues
    conn = SimpleNamespace(transport=SimpleNamespace(driver_type="amqp"), release=lambda: None)
    monkeypatch.setattr(current_app, "connection_for_write", lambda: conn)
    monkeypatch.setitem(current_app.conf, "task_queue_max_priority", 9)
    settings.CLEANUP_RABBITMQ_QUEUE_TYPE = "quorum"
    # when/then: the worker's start-up stops, naming the setting
    with pytest.raises(SystemExit, match="refusing to start: CLEANUP_RABBITMQ_QUEUE_TYPE=quorum"):
        refuse_queues_of_another_type()
