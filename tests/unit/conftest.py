"""Fixtures for the unit tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import current_app
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from cleanup.broker.readers import redis_client
from reservations import services
from tests.support.fleet import SessionFleet
from tests.support.sentinel import PrivateSentinel


@pytest.fixture
def other_session() -> Iterator[BaseDatabaseWrapper]:
    """A second PostgreSQL session, as another worker's would be."""
    other = connections.create_connection("default")
    try:
        yield other
    finally:
        other.close()


@pytest.fixture
def leading_beat(settings: Any) -> Iterator[tuple[Any, Any]]:
    """Beat's scheduler holding its lease (a lock id of this process's own, so no other run's
    beat stands in the way) and the schedule's sweep entry; the scheduler closed afterwards."""
    from cleanup.release.schedule import LeaderDatabaseScheduler, install_schedule
    from cleanup.wire import SWEEP_TASK
    from config.celery_app import app

    settings.CLEANUP_BEAT_LOCK_ID = 900_000 + os.getpid() % 100_000
    install_schedule(shards=1, every=1)
    scheduler = LeaderDatabaseScheduler(app=app)
    try:
        assert scheduler._hold_lock()
        yield scheduler, next(e for e in scheduler.schedule.values() if e.task == SWEEP_TASK)
    finally:
        scheduler.close()


@pytest.fixture
def t0() -> datetime:
    """Now, as the explicit ``now=`` the domain's services accept from unit tests."""
    return timezone.now()


@pytest.fixture
def seats_are_conserved_after_every_test(db: None) -> Iterator[None]:
    """After the test, every offering's seats add up (capacity = free + held + confirmed)."""
    yield
    assert services.seat_conservation_violations() == []


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    """The tests' own Redis database number (never another), empty before and after the test."""
    client = redis_client()
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture(autouse=True)
def no_worker_consuming(session_fleet: SessionFleet) -> None:
    """Unit tests write queues and kombu's ``unacked`` hash in the tests' Redis database and read
    them back: no worker of the session's fleet may be consuming them, whatever order the tests
    run in. Pausing is a no-op when the fleet is not running (the usual case: unit tests are
    collected first, or run in a pytest of their own as scripts/test.sh does)."""
    session_fleet.pause()


@pytest.fixture
def run_task() -> Callable[..., Any]:
    """Run a task's body as a worker would, found by its name in the Celery app (as a message
    names it), so a test does not depend on where the task's code lives."""
    import cleanup.tasks  # noqa: F401  (registers the project's tasks with the app)

    def run(name: str, *args: Any, task_id: str = "test-task") -> Any:
        task = current_app.tasks[name]
        task.push_request(id=task_id, retries=0)
        try:
            return task(*args)
        finally:
            task.pop_request()

    return run


# Set by pytest itself around each phase of a test.
PYTEST_OWN_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})
ENVIRONMENT_BEFORE = pytest.StashKey[dict[str, str]]()


@pytest.fixture(autouse=True)
def environment_left_as_found(request: pytest.FixtureRequest) -> None:
    """A variable a test leaves in ``os.environ`` changes every test after it, so the suite's
    result would depend on the order the tests run in (they run shuffled). The environment is
    noted here, once the session's fixtures are set up, and compared once the test's own
    fixtures are torn down (``pytest_runtest_teardown`` below: ``monkeypatch`` is set up before
    this fixture, by pytest-django, and so put back after it). Set variables with
    ``monkeypatch.setenv``/``delenv``, and record with monkeypatch what product code sets
    (``os.environ[...] = ...``) before calling it."""
    request.node.stash[ENVIRONMENT_BEFORE] = dict(os.environ)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """The test that left ``os.environ`` changed fails here, naming the variables; they are put
    back, so the rest of the session runs as if it had not."""
    yield
    before = item.stash.get(ENVIRONMENT_BEFORE, None)
    if before is None:  # the test's setup failed before the fixture ran
        return
    after = dict(os.environ)
    changed = sorted(
        name
        for name in before.keys() | after.keys()
        if name not in PYTEST_OWN_VARIABLES and before.get(name) != after.get(name)
    )
    if not changed:
        return
    for name in changed:
        if name in before:
            os.environ[name] = before[name]
        else:
            del os.environ[name]
    pytest.fail(
        f"the test left os.environ changed: {', '.join(changed)} (use monkeypatch.setenv or "
        "delenv, or record with monkeypatch what the code under test sets; put back now)",
        pytrace=False,
    )


@pytest.fixture
def private_sentinel(tmp_path: Path) -> Iterator[PrivateSentinel]:
    """A Redis master and a sentinel watching it, for the test."""
    server = PrivateSentinel(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()
