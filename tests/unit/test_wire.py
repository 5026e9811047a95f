"""The task names on the wire (cleanup.wire): the strings messages already in queues carry, the
tasks the worker registers under them, and the queues settings route them to."""

from __future__ import annotations

from django.conf import settings

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

    queues = {queue.name for queue in settings.CELERY_TASK_QUEUES}
    assert settings.CELERY_TASK_ROUTES == wire.task_routes(cleanup_settings())
    assert {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()} <= queues
    conf = cleanup_settings()
    for name, setting in wire.QUEUE_SETTING.items():
        routed = app.amqp.router.route({}, name)
        assert routed["queue"].name == getattr(conf, setting), name
    # A project task not on the list (a test's own task, say) goes to maintenance.
    assert app.amqp.router.route({}, "cleanup.other")["queue"].name == conf.maintenance_queue
