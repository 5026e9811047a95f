"""What a schedule change would do, without doing it (cleanup.operations.schedule_preview):
``install_cleanup_schedule --dry-run`` and the admin's "Preview the change" say what the real
run would do and write nothing."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import PeriodicTask

from cleanup.models import CleanupSchedule
from cleanup.operations.schedule_preview import snapshot
from cleanup.release.schedule import SWEEP_PREFIX, install_schedule, sweep_entry_name
from tests.support.staff import login_staff

pytestmark = [pytest.mark.django_db]


def _dry_run(*args: str) -> str:
    out = StringIO()
    call_command("install_cleanup_schedule", "--dry-run", *args, stdout=out)
    return out.getvalue()


def test_a_dry_run_on_an_empty_database_lists_what_it_would_create_and_writes_nothing() -> None:
    text = _dry_run("--shards", "2", "--every", "5")
    assert text.splitlines()[0] == "dry run: nothing is written"
    assert "would add 5 entries" in text  # 2 sweeps, relay, prune, sample
    assert f"  {sweep_entry_name(0, 2)}" in text and f"  {sweep_entry_name(1, 2)}" in text
    assert "sweeps per second: 0 -> 0.4" in text
    assert not PeriodicTask.objects.exists() and not CleanupSchedule.objects.exists()


def test_a_forced_dry_run_shows_the_reshard_and_matches_what_the_real_run_then_does() -> None:
    install_schedule(shards=4, every=10)
    before = snapshot()
    text = _dry_run("--shards", "2", "--every", "4", "--force")
    assert snapshot() == before  # nothing written
    assert "would add 2 entries" in text and "would remove 4 entries" in text
    assert "sweeps per second: 0.4 -> 0.5" in text
    removed = re.findall(rf"^  ({SWEEP_PREFIX}\d+ of 4)$", text, re.M)
    # when the same change runs for real, it does what the dry run said
    call_command(
        "install_cleanup_schedule", "--shards", "2", "--every", "4", "--force", stdout=StringIO()
    )
    names = set(snapshot())
    assert not names & set(removed) and len(removed) == 4
    assert {sweep_entry_name(0, 2), sweep_entry_name(1, 2)} <= names


def test_a_dry_run_that_keeps_the_existing_schedule_says_nothing_changes() -> None:
    install_schedule(shards=3, every=6)
    text = _dry_run("--shards", "8", "--every", "1")  # without --force an edit survives
    assert "no entry would change" in text and "sweeps per second: 0.5 -> 0.5" in text


def test_the_admin_preview_shows_the_change_and_saves_nothing(root_client: Client) -> None:
    install_schedule(shards=4, every=10)
    schedule = CleanupSchedule.objects.get()
    url = reverse("admin:cleanup_cleanupschedule_preview", args=[schedule.pk])
    before = snapshot()
    page = root_client.post(url, {"shards": "8", "every_seconds": "20", "enabled": "on"})
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="preview-added">add 8 entries' in html
    assert 'id="preview-removed">remove 4 entries' in html
    assert "<strong>0.4</strong> now, <strong>0.4</strong> after the save" in html
    assert snapshot() == before
    assert (CleanupSchedule.objects.get().shards, CleanupSchedule.objects.get().every_seconds) == (
        4,
        10,
    )
    # disabling: every sweep entry changes, the rate drops to 0
    page = root_client.post(url, {"shards": "4", "every_seconds": "10"})
    assert 'id="preview-changed">change 4 entries' in page.content.decode()
    assert "<strong>0</strong> after the save" in page.content.decode()
    # invalid values: the form's own messages, no preview
    page = root_client.post(url, {"shards": "0", "every_seconds": "10"})
    assert "errornote" in page.content.decode() and "preview-added" not in page.content.decode()


def test_the_change_form_offers_the_preview_button(root_client: Client) -> None:
    install_schedule(shards=2, every=10)
    schedule = CleanupSchedule.objects.get()
    page = root_client.get(reverse("admin:cleanup_cleanupschedule_change", args=[schedule.pk]))
    preview = reverse("admin:cleanup_cleanupschedule_preview", args=[schedule.pk])
    assert f'formaction="{preview}" formmethod="post"' in page.content.decode()


def test_the_preview_needs_change_permission(db: None) -> None:
    install_schedule(shards=2, every=10)
    client = login_staff("viewer")
    url = reverse("admin:cleanup_cleanupschedule_preview", args=[CleanupSchedule.objects.get().pk])
    assert client.post(url, {"shards": "8", "every_seconds": "1"}).status_code == 403
