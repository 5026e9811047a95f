"""The Celery app (config.celery_app) is the one cleanup's modules reach from any thread."""

from __future__ import annotations

import threading

import pytest

# Every test starts and ends with the tests' own Redis database empty.
pytestmark = pytest.mark.usefixtures("broker")


def test_cleanup_reaches_the_configured_app_from_any_thread() -> None:
    """cleanup's modules use ``celery.current_app`` (they never import config): in a thread
    other than the one that created the app, it must still be the configured app."""

    from celery import current_app

    from config.celery_app import app

    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(current_app.main))
    thread.start()
    thread.join()
    assert seen == [app.main] == ["reservations"]
