"""The schedule controls in a real browser (Playwright + Debian's chromium, live server, real
PostgreSQL): the Cleanup schedule's "Preview the change" shows what a save would do and saves
nothing until the operator confirms; the periodic-task admin refuses a sub-second interval and a
foreign queue for a task of this project, with the reason next to the field."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from cleanup.models import CleanupSchedule
from cleanup.release.schedule import SWEEP_PREFIX, install_schedule, sweep_entry_name

pytestmark = [pytest.mark.browser]


def _sweep_names() -> set[str]:
    return set(
        PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX).values_list("name", flat=True)
    )


def test_previewing_a_reshard_shows_its_effect_and_saves_only_when_confirmed(
    signed_in: Any, live_server: Any, shots: Any
) -> None:
    page = signed_in
    install_schedule(shards=4, every=10)
    # given: the schedule form; the operator types 2 shards every 4 s
    page.goto(live_server.url + reverse("admin:cleanup_cleanupschedule_changelist"))
    page.fill("#id_shards", "2")
    page.fill("#id_every_seconds", "4")
    # when: "Preview the change"
    page.click("#preview-button")
    page.wait_for_selector("#preview-summary")
    page.screenshot(path=str(shots / "schedule-preview.png"), full_page=True)
    # then: what the save would do, and nothing saved yet
    assert page.inner_text("#preview-added").startswith("add 2 entries")
    assert sweep_entry_name(1, 2) in page.inner_text("#preview-added")
    assert page.inner_text("#preview-removed").startswith("remove 4 entries")
    assert "0.4 now, 0.5 after the save" in page.inner_text("#preview-rate")
    assert _sweep_names() == {sweep_entry_name(k, 4) for k in range(4)}
    assert CleanupSchedule.objects.get().shards == 4
    # when: the operator confirms
    page.click("#save-previewed")
    page.wait_for_selector(".messagelist")
    # then: the entries are the previewed ones
    assert _sweep_names() == {sweep_entry_name(k, 2) for k in range(2)}
    schedule = CleanupSchedule.objects.get()
    assert (schedule.shards, schedule.every_seconds) == (2, 4)


def _add_entry(page: Any, live_server: Any, every: str, period: str, queue: str = "") -> None:
    interval, _ = IntervalSchedule.objects.get_or_create(every=int(every), period=period)
    page.goto(live_server.url + reverse("admin:django_celery_beat_periodictask_add"))
    page.fill("#id_name", "an operator's entry")
    page.select_option("#id_regtask", "cleanup.prune")
    page.select_option("#id_interval", str(interval.pk))
    if queue:
        # the queue is under the collapsed "Execution Options": open it as an operator would
        page.click("details:has(#id_queue) > summary")
        page.fill("#id_queue", queue)
    page.click("input[name=_save]")


def test_the_periodic_task_admin_refuses_a_sub_second_interval_and_a_foreign_queue(
    signed_in: Any, live_server: Any, shots: Any
) -> None:
    page = signed_in
    # a quarter of a second for the prune task: refused, the reason on the interval field
    _add_entry(page, live_server, "250000", IntervalSchedule.MICROSECONDS)
    page.wait_for_selector(".errornote")
    error = page.inner_text(".field-interval .errorlist")
    assert "cleanup.prune would be sent every 0.25 s" in error
    assert "CLEANUP_PERIODIC_MIN_INTERVAL" in error
    page.screenshot(path=str(shots / "periodic-task-refused.png"), full_page=True)
    # a queue no cleanup worker consumes: refused, naming the project's queues
    _add_entry(page, live_server, "60", IntervalSchedule.SECONDS, queue="celery")
    page.wait_for_selector(".errornote")
    error = page.inner_text(".field-queue .errorlist")
    assert "'celery' is not one of this project's queues (sweep, cleanup, maintenance)" in error
    assert not PeriodicTask.objects.filter(name="an operator's entry").exists()
    # the same entry every minute on the maintenance queue is saved
    _add_entry(page, live_server, "60", IntervalSchedule.SECONDS, queue="maintenance")
    page.wait_for_selector(".messagelist")
    saved = PeriodicTask.objects.get(name="an operator's entry")
    assert (saved.task, saved.queue, saved.interval.every) == ("cleanup.prune", "maintenance", 60)
