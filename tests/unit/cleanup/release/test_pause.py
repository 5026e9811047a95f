"""The "pause releases" switch (cleanup.release.pause), from the console: set from the health page
by a user allowed to, with a reason, audited (one history entry per change), shown with since
when and by whom. The gauges: cleanup/operations/console/test_gauges.py; the workers' side:
cleanup/worker/test_pause.py and tests/integration/test_release_pause.py; the browser's,
tests/integration/browser/."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from cleanup.models import ReleasePause
from cleanup.release import pause
from tests.support.metrics import pause_gauges
from tests.support.staff import login_staff

pytestmark = [pytest.mark.django_db]

HEALTH = "/admin/cleanup/health/?workers=0"


@pytest.fixture
def operator() -> Client:
    return login_staff("ops", "change_releasepause", "view_releasepause")


def _post(client: Client, action: str, reason: str = "") -> str:
    page = client.post(reverse("cleanup-pause"), {"action": action, "reason": reason}, follow=True)
    assert page.status_code == 200
    return page.content.decode()


def test_pausing_shows_since_when_and_why_and_leaves_one_history_entry(operator: Client) -> None:
    # when: the operator pauses with a reason
    html = _post(operator, "pause", "database migration")
    # then: the health page says so, with since when and by whom
    assert 'id="pause-state">releases paused</span>' in html
    assert 'id="paused-by">ops</strong>' in html and "database migration" in html
    assert 'id="resume-button"' in html and 'id="pause-button"' not in html
    row = ReleasePause.objects.get()
    assert row.paused and row.since is not None and row.changed_by == "ops"
    assert f"{row.since:%Y-%m-%d %H:%M:%S} UTC" in html
    entry = LogEntry.objects.get()
    assert entry.change_message == "releases: paused (database migration)"
    assert entry.user_id == get_user_model().objects.get(username="ops").pk
    assert entry.object_id == str(row.pk)
    # and Prometheus sees it (the paused-too-long alert reads the age)
    gauges = pause_gauges()
    assert gauges["reservation_cleanup_releases_paused"] == 1
    assert gauges["reservation_cleanup_releases_paused_seconds"] >= 0


def test_resuming_is_audited_too_and_a_repeated_click_changes_nothing(operator: Client) -> None:
    _post(operator, "pause", "incident")
    html = _post(operator, "pause", "again")  # another tab
    assert "already paused" in html
    html = _post(operator, "resume")
    assert 'id="pause-state">releases running</span>' in html
    assert not pause.state().paused
    assert list(LogEntry.objects.order_by("pk").values_list("change_message", flat=True)) == [
        "releases: paused (incident)",
        "releases: resumed",
    ]
    assert pause_gauges() == {
        "reservation_cleanup_releases_paused": 0,
        "reservation_cleanup_releases_paused_seconds": 0,
    }


def test_a_pause_needs_a_reason(operator: Client) -> None:
    html = _post(operator, "pause", "   ")
    assert "Say why releases are paused" in html
    assert not pause.state().paused and not LogEntry.objects.exists()


def test_a_user_without_the_permission_sees_the_state_but_no_switch() -> None:
    viewer = login_staff("viewer", "view_releasepause")
    html = viewer.get(HEALTH).content.decode()
    assert 'id="pause-state">releases running</span>' in html
    assert 'id="pause-button"' not in html
    page = viewer.post(reverse("cleanup-pause"), {"action": "pause", "reason": "x"})
    assert page.status_code == 403
    assert not pause.state().paused and not LogEntry.objects.exists()
