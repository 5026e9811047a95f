"""RabbitMQ's queue types (cleanup.broker.queues, CLEANUP_RABBITMQ_QUEUE_TYPE): the declarations
of both types, the settings that go with quorum queues and the ones refused, Celery's per-consumer
QoS with them, the headers RabbitMQ adds, the broker's own delivery count, and a queue of another
type refused. The queues on a real cluster: tests/integration/test_rabbitmq_cluster.py."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
from amqp.exceptions import PreconditionFailed
from celery.utils.quorum_queues import detect_quorum_queues
from celery.worker.consumer.tasks import Tasks
from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from cleanup import wire
from cleanup.broker import queues, screening
from cleanup.conf import QUORUM_DELIVERY_LIMIT, CleanupSettings
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
