"""What the periodic-task admin refuses for this project's tasks (cleanup.release.periodic_guard):
an interval below CLEANUP_PERIODIC_MIN_INTERVAL and a queue that is not one of the project's,
with the reason on the field; another application's entries are left alone."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import IntervalSchedule, PeriodicTask

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


def test_a_sane_project_entry_and_another_applications_entry_are_saved(
    root_client: Client,
) -> None:
    assert _add_task(root_client, every="1", queue="maintenance").startswith("saved 302")
    # tasks of other applications are left to them, whatever their interval and queue
    assert _add_task(
        root_client, name="theirs", task="billing.tick", every="100",
        period=IntervalSchedule.MICROSECONDS, queue="billing",
    ).startswith("saved 302")  # fmt: skip
    assert set(PeriodicTask.objects.values_list("name", flat=True)) == {"my entry", "theirs"}


def test_the_floor_follows_the_setting(root_client: Client, settings: Any) -> None:
    settings.CLEANUP_PERIODIC_MIN_INTERVAL = 30
    html = _add_task(root_client, every="10")
    assert "cleanup.prune would be sent every 10 s" in html
    assert "run at most once every 30 s" in html
