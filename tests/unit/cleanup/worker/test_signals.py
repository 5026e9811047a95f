"""The workers' signal handlers (cleanup.worker.signals): a worker refuses to start with
priorities on quorum queues."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest


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
