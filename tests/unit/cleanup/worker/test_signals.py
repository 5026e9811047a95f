"""The workers' signal handlers (cleanup.worker.signals): a worker refuses to start with
priorities on quorum queues; a host project's own worker is left alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest


def test_a_worker_refuses_to_start_with_priorities_on_quorum_queues(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cleanup.broker.celery_app import app
    from cleanup.worker.signals import refuse_queues_of_another_type

    # given: a RabbitMQ connection (never opened: the refusal comes first) and quorum queues
    conn = SimpleNamespace(transport=SimpleNamespace(driver_type="amqp"), release=lambda: None)
    monkeypatch.setattr(app, "connection_for_write", lambda: conn)
    monkeypatch.setitem(app.conf, "task_queue_max_priority", 9)
    settings.CLEANUP_RABBITMQ_QUEUE_TYPE = "quorum"
    # when/then: the worker's start-up stops, naming the setting
    with pytest.raises(SystemExit, match="refusing to start: CLEANUP_RABBITMQ_QUEUE_TYPE=quorum"):
        refuse_queues_of_another_type(sender=SimpleNamespace(app=app))


def test_a_host_projects_own_worker_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host project runs its own Celery app beside the apps' one: the handlers act for
    the apps' app only, whatever the host's queues are."""
    from celery import Celery

    from cleanup.worker.signals import refuse_queues_of_another_type

    host = Celery("host", set_as_current=False)
    monkeypatch.setitem(host.conf, "task_queue_max_priority", 9)
    opened: list[bool] = []
    monkeypatch.setattr(host, "connection_for_write", lambda: opened.append(True))
    refuse_queues_of_another_type(sender=SimpleNamespace(app=host))
    assert opened == []
