"""The task names on the wire (cleanup.wire): the strings messages already in queues carry, the
tasks the worker registers under them, and the queues settings route them to."""

from __future__ import annotations

from typing import Any

from cleanup import wire
from cleanup.conf import cleanup_settings


def test_the_names_on_the_wire_are_the_ones_queued_messages_carry() -> None:
    # Written out by hand: renaming one would orphan every message, dead letter and periodic
    # task row that carries the old name.
    assert wire.TASKS == (
        "cleanup.sweep_shard",
        "cleanup.release_reservation",
        "cleanup.release_batch",
        "cleanup.relay_outbox",
        "cleanup.prune",
        "cleanup.sample_health",
    )
    assert all(name.startswith(wire.TASK_PREFIX) for name in wire.TASKS)


def test_every_name_on_the_wire_is_a_task_the_worker_registers_and_no_other() -> None:
    import cleanup.tasks  # noqa: F401 - registers the tasks
    from config.celery_app import app

    registered = {name for name in app.tasks if name.startswith(wire.TASK_PREFIX)}
    assert registered == set(wire.TASKS)


def test_every_task_routes_to_its_configured_queue() -> None:
    from config.celery_app import app

    queues = {queue.name for queue in app.conf.task_queues}
    assert app.conf.task_routes == wire.task_routes(cleanup_settings())
    assert {route["queue"] for route in app.conf.task_routes.values()} <= queues
    conf = cleanup_settings()
    for name, setting in wire.QUEUE_SETTING.items():
        routed = app.amqp.router.route({}, name)
        assert routed["queue"].name == getattr(conf, setting), name
    # A project task not on the list (a test's own task, say) goes to maintenance.
    assert app.amqp.router.route({}, "cleanup.other")["queue"].name == conf.maintenance_queue


def test_a_sent_message_is_the_json_workers_already_read() -> None:
    """The typed messages serialise to the same JSON, key for key and in the same order, as the
    messages already in queues (written out by hand here, as tests/support/wire.py does)."""
    import json
    from datetime import UTC, datetime

    from cleanup.release.messages import BatchMessage, ReleaseMessage, validate, validate_batch

    at = datetime(2026, 1, 1, tzinfo=UTC)
    one = ReleaseMessage.for_hold(7, 2, at, 3, "t")
    assert json.dumps(one.as_dict()) == (
        '{"schema_version": 1, "reservation_id": 7, "version": 2, '
        '"expires_at": "2026-01-01T00:00:00+00:00", "idempotency_key": "release:7:2", '
        '"shard": 3, "trace_id": "t"}'
    )
    many = BatchMessage.for_holds([(7, 2, at), (8, 1, at)], 3, "t")
    assert json.dumps(many.as_dict()) == (
        '{"schema_version": 1, "kind": "release_batch", "shard": 3, "trace_id": "t", "items": ['
        '{"reservation_id": 7, "version": 2, "expires_at": "2026-01-01T00:00:00+00:00", '
        '"idempotency_key": "release:7:2"}, '
        '{"reservation_id": 8, "version": 1, "expires_at": "2026-01-01T00:00:00+00:00", '
        '"idempotency_key": "release:8:1"}]}'
    )
    # and a worker reads back what was sent
    assert validate(one.as_dict()) == one
    assert validate_batch(many.as_dict()) == many


def test_each_kind_of_message_is_published_to_its_task(broker: Any) -> None:
    import base64
    import json
    from datetime import UTC, datetime

    from cleanup.broker.readers import priority_keys
    from cleanup.release.messages import BatchMessage, ReleaseMessage
    from cleanup.release.publish import publish_release_messages

    at = datetime(2026, 1, 1, tzinfo=UTC)
    one = ReleaseMessage.for_hold(7, 2, at, 0, "t")
    many = BatchMessage.for_holds([(8, 1, at)], 0, "t")
    publish_release_messages([one, many])
    queued = [
        json.loads(raw)
        for key in priority_keys(cleanup_settings().release_queue)
        for raw in broker.lrange(key, 0, -1)
    ]
    sent = {q["headers"]["task"]: json.loads(base64.b64decode(q["body"]))[0][0] for q in queued}
    assert sent == {wire.RELEASE_TASK: one.as_dict(), wire.RELEASE_BATCH_TASK: many.as_dict()}
