"""What the periodic-task admin refuses for any periodic task (cleanup.release.periodic_guard): a
task that is not one of this project's periodic tasks (Celery's built-ins too), an interval below
CLEANUP_PERIODIC_MIN_INTERVAL and a queue that is not one of the project's, with the reason on the
field; and what beat's scheduler does with such a row planted in the table: skips it."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from cleanup.broker.celery_app import app
from cleanup.release.schedule import LeaderDatabaseScheduler, SendBucket
from cleanup.wire import RELEASE_TASK
from tests.support.staff import login_staff

pytestmark = [pytest.mark.django_db]


def _add_task(client: Client, **fields: str) -> str:
    interval, _ = IntervalSchedule.objects.get_or_create(
        every=int(fields.pop("every", "10")), period=fields.pop("period", IntervalSchedule.SECONDS)
    )
    data = {
        "name": fields.pop("name", "my entry"),
        "regtask": "",
        "task": fields.pop("task", "cleanup.prune"),
        "enabled": "on",
        "interval": str(interval.pk),
        "args": "[]",
        "kwargs": "{}",
        "queue": "",
        "exchange": "",
        "routing_key": "",
        "priority": "",
        "headers": "{}",
        "expire_seconds": "",
        "description": "",
        **fields,
    }
    page = client.post(reverse("admin:django_celery_beat_periodictask_add"), data)
    return page.content.decode() if page.status_code == 200 else f"saved {page.status_code}"


def test_a_sub_second_interval_for_a_project_task_is_refused_with_the_reason(
    root_client: Client,
) -> None:
    html = _add_task(root_client, every="500000", period=IntervalSchedule.MICROSECONDS)
    assert "cleanup.prune would be sent every 0.5 s" in html
    assert "CLEANUP_PERIODIC_MIN_INTERVAL" in html
    assert not PeriodicTask.objects.filter(name="my entry").exists()


def test_a_foreign_queue_for_a_project_task_is_refused_naming_the_projects_queues(
    root_client: Client,
) -> None:
    html = _add_task(root_client, queue="celery")
    assert (
        "&#x27;celery&#x27; is not one of this project&#x27;s queues (sweep, cleanup, maintenance)"
        in html
    )
    html = _add_task(root_client, routing_key="elsewhere")
    assert "does not route to one of this project&#x27;s queues" in html
    html = _add_task(root_client, exchange="amq.direct")
    assert "routed by queue, not by exchange" in html
    assert not PeriodicTask.objects.filter(name="my entry").exists()


def test_a_sane_project_entry_is_saved(root_client: Client) -> None:
    assert _add_task(root_client, every="1", queue="maintenance").startswith("saved 302")
    assert set(PeriodicTask.objects.values_list("name", flat=True)) == {"my entry"}


def test_a_staff_user_who_may_add_periodic_tasks_cannot_save_a_celery_built_in_at_1_us() -> None:
    # given a staff user whose only rights are to view and add periodic tasks
    staff = login_staff(
        "scheduler", "view_periodictask", "add_periodictask", "view_intervalschedule",
        app_label="django_celery_beat",
    )  # fmt: skip
    # when they pick Celery's built-in task from the list, every 1 µs, on the release queue
    html = _add_task(
        staff, task="", regtask="celery.backend_cleanup", every="1",
        period=IntervalSchedule.MICROSECONDS, queue="cleanup",
    )  # fmt: skip
    # then the form says why, on the task and on the interval, and nothing is saved
    assert (
        "&#x27;celery.backend_cleanup&#x27; is not one of this project&#x27;s periodic tasks"
        in (html)
    )
    assert "celery.backend_cleanup would be sent every 1e-06 s" in html
    assert not PeriodicTask.objects.exists()


def test_another_applications_task_and_a_release_task_are_refused(root_client: Client) -> None:
    html = _add_task(root_client, name="theirs", task="billing.tick", every="100")
    assert "&#x27;billing.tick&#x27; is not one of this project&#x27;s periodic tasks" in html
    html = _add_task(root_client, name="releases", task=RELEASE_TASK, every="100")
    assert f"&#x27;{RELEASE_TASK}&#x27; is not one of this project&#x27;s periodic tasks" in html
    assert not PeriodicTask.objects.exists()


def _plant(name: str, task: str, every: int, period: str, **fields: str) -> None:
    interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=period)
    PeriodicTask.objects.create(name=name, task=task, interval=interval, **fields)


def test_beats_scheduler_skips_and_counts_rows_the_form_would_refuse(caplog: Any) -> None:
    # given rows written straight into the table, past the admin form
    _plant("built-in", "celery.backend_cleanup", 1, IntervalSchedule.MICROSECONDS, queue="cleanup")
    _plant("fast prune", "cleanup.prune", 1, IntervalSchedule.MICROSECONDS)
    _plant("elsewhere", "cleanup.prune", 10, IntervalSchedule.SECONDS, queue="celery")
    _plant("fine", "cleanup.prune", 10, IntervalSchedule.SECONDS, queue="maintenance")
    scheduler = LeaderDatabaseScheduler(app=app, lazy=True)
    # when beat reads its schedule
    with caplog.at_level("ERROR", logger="cleanup.schedule"):
        entries = scheduler.all_as_schedule()
    # then only the acceptable row is an entry; each other one is logged and counted
    assert set(entries) == {"fine"}
    assert scheduler.refused_total == 3
    refused = [r for r in caplog.records if r.getMessage().startswith("periodic task refused")]
    assert sorted(r.entry for r in refused) == ["built-in", "elsewhere", "fast prune"]
    # and beat saves no built-in entry of its own at start-up
    scheduler.install_default_entries({})
    assert not PeriodicTask.objects.filter(
        task="celery.backend_cleanup", name="celery.backend_cleanup"
    ).exists()


def test_the_send_bucket_spaces_sends_at_its_rate() -> None:
    now = [0.0]
    bucket = SendBucket(4, clock=lambda: now[0])
    assert bucket.wait() == 0
    bucket.take()
    assert bucket.wait() == pytest.approx(0.25)
    now[0] = 0.1
    assert bucket.wait() == pytest.approx(0.15)
    now[0] = 10.0  # idle for long: still one send at once, not a burst of forty
    bucket.take()
    assert bucket.wait() == pytest.approx(0.25)


def test_the_floor_follows_the_setting(root_client: Client, settings: Any) -> None:
    settings.CLEANUP_PERIODIC_MIN_INTERVAL = 30
    html = _add_task(root_client, every="10")
    assert "cleanup.prune would be sent every 10 s" in html
    assert "run at most once every 30 s" in html
