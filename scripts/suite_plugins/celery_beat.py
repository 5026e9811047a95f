"""django-celery-beat's own scheduler tests (``t/unit/test_schedulers.py`` of its sdist) with
``django_celery_beat.schedulers.DatabaseScheduler`` replaced by our ``LeaderDatabaseScheduler``
(``cleanup.release.schedule``): the suite's tests and its ``TrackingScheduler(DatabaseScheduler)``
then run our lease, ``tick``, ``reserve``, ``apply_entry`` and ``close`` around the library's
code, with every row admitted (the product's periodic-task policy is not the library's).
Settings: ``suite_plugins.celery_beat_settings``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
from django.apps import AppConfig

from suite_plugins import report, select

SUITE = "t/unit/test_schedulers.py"

DESELECT = {
    f"{SUITE}::test_modeladmin_PeriodicTaskAdmin::{name}": (
        "the admin's run-task action (no scheduler involved) makes the suite's Celery app "
        "autodiscover tasks in every installed app; cleanup is installed for our scheduler's "
        "import, and cleanup.tasks needs the product's settings"
    )
    for name in ("test_run_task", "test_run_tasks", "test_run_task_headers")
}
DESELECT[f"{SUITE}::test_DatabaseScheduler::test_heap_always_return_the_first_item"] = (
    "fails with django-celery-beat's own DatabaseScheduler too, without any swap (seen here: "
    "both entries were tried, the test expects only the first); about 25 s of real sleeps"
)
for name in (
    "test_DatabaseSchedulerFromAppConf::test_periodic_task_model_enabled_schedule",
    "test_DatabaseSchedulerFromAppConf::test_periodic_task_model_disabled_schedule",
    "test_DatabaseScheduler::test_all_as_schedule",
    "test_DatabaseScheduler::test_starttime_trigger",
):
    DESELECT[f"{SUITE}::{name}"] = (
        "expects the celery.backend_cleanup entry django-celery-beat installs; ours installs "
        "none (the project keeps no task results, and only its own periodic tasks are sent)"
    )
# Passes, but costs one to two minutes of wall-clock time: it ticks until a crontab minute
# arrives (its iteration cap is never incremented). Run it with
# `scripts/library_suites.py --include-slow`.
SLOW = {
    f"{SUITE}::test_DatabaseScheduler::test_crontab_with_start_time_tick": (
        "passes; ticks for one to two minutes of wall-clock time (run with --include-slow)"
    ),
}


class CleanupModelsOnly(AppConfig):
    """The cleanup app for its models only: no ``ready()`` connecting the product's signals."""

    name = "cleanup"
    label = "cleanup"


def pytest_sessionstart(session: pytest.Session) -> None:
    # After pytest-django's django.setup(), before the test module (whose TrackingScheduler
    # subclasses schedulers.DatabaseScheduler at import) is collected.
    from django_celery_beat import schedulers

    from cleanup.release import schedule

    schedulers.DatabaseScheduler = schedule.LeaderDatabaseScheduler  # type: ignore[misc]

    # The product's lease connection parameters, on the server's ``postgres`` database: the
    # default database's name is SQLite's in-memory test database's during the tests (see
    # suite_plugins.celery_beat_settings). One of the two product functions replaced in this run.
    product_lock_conninfo = schedule._lock_conninfo

    def lease_on_the_postgres_database() -> dict[str, Any]:
        return {**product_lock_conninfo(), "dbname": "postgres"}

    schedule._lock_conninfo = lease_on_the_postgres_database

    # Which rows beat may send is the product's policy (``cleanup.release.periodic_guard``:
    # the project's own periodic tasks, its queues, the interval floor), tested by the product's
    # own tests; the library's tests schedule tasks and queues of their own, which it would
    # skip. The second and last product function replaced in this run.
    from cleanup.release import periodic_guard

    periodic_guard.row_problems = lambda row: {}


@pytest.fixture(autouse=True)
def _schedulers_let_go_of_the_lease_when_the_test_ends() -> Iterator[None]:
    """A beat's lease is a session of its process, which ends with it; the suite's tests build
    schedulers and never close them, so a scheduler of the previous test would still hold the
    lease and the next test's could never send. Ending each one's lease session at the end of
    its test stands in for its process ending."""
    yield
    from cleanup.release.schedule import LeaderDatabaseScheduler

    for scheduler in gc.get_objects():
        if isinstance(scheduler, LeaderDatabaseScheduler):
            scheduler._drop_lock("the test ended")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from cleanup.release.schedule import LeaderDatabaseScheduler

    if not any(
        isinstance(item, pytest.Function)
        and issubclass(item.module.TrackingScheduler, LeaderDatabaseScheduler)  # type: ignore[attr-defined]
        for item in items
    ):
        raise pytest.UsageError(
            "django-celery-beat's suite is not running against LeaderDatabaseScheduler"
        )
    deselect = dict(DESELECT)
    if not config.getoption("include_slow"):
        deselect.update(SLOW)
    select(items, config, deselect, "django-celery-beat")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--include-slow", action="store_true", help="also run " + ", ".join(SLOW))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    report(terminalreporter, "deselected", DESELECT)
    report(terminalreporter, "deselected unless --include-slow", SLOW)
