"""The example project's Celery app (config.celery_app) is the apps' own, the default of every
thread; beside a host project's app, the apps still publish through their own."""

from __future__ import annotations

import threading

import pytest
from celery import Celery, current_app

from cleanup.celery import app
from cleanup.release import outbox, publish

# Every test starts and ends with the tests' own Redis database empty.
pytestmark = pytest.mark.usefixtures("broker")


def test_the_project_app_is_the_apps_own_and_every_threads_default() -> None:
    from config.celery_app import app as project_app

    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(current_app.main))
    thread.start()
    thread.join()
    assert project_app is app
    assert seen == [app.main] == ["reservation-cleanup"]


def test_a_host_app_made_current_does_not_take_the_apps_publishing() -> None:
    """A host project's Celery app becomes the current one when it is created; the apps'
    modules keep publishing through theirs, with its policy (acks_late, JSON, its queues)."""
    host = Celery("host")
    try:
        assert current_app.main == "host"
        assert publish.app is app and outbox.app is app
        assert app.conf.task_acks_late and app.conf.accept_content == ["json"]
        assert not host.conf.task_acks_late
        assert host.conf.task_default_queue == "celery"
    finally:
        app.set_current()
