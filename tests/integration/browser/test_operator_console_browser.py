"""The operator console, driven as an operator would in a real browser (Playwright + Debian's
chromium) against the live server, with real PostgreSQL and Redis, and real beat and worker
processes where the schedule is claimed to be followed."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse
from django.utils import timezone

from cleanup.models import CleanupSchedule, DeadLetter
from cleanup.operations import samples
from cleanup.release.messages import ReleaseMessage, build
from cleanup.release.publish import publish_release_messages
from cleanup.release.schedule import install_schedule
from tests.support.fleet import (
    beats,
    claim_counts,
    create_eligible_holds,
    released_count,
    scalar,
    sql,
    wait_until,
)

from .conftest import PASSWORD, USERNAME

pytestmark = [pytest.mark.browser]

HEALTH = "/admin/cleanup/health/"


def number(text: str) -> float:
    found = re.search(r"-?\d+(\.\d+)?", text.replace(",", ""))
    assert found, f"no number in {text!r}"
    return float(found.group(0))


def tab_to(page: Any, selector: str, limit: int = 80) -> None:
    """Press Tab until ``selector`` has the focus (keyboard only, no clicks)."""
    target = page.locator(selector).first
    for _ in range(limit):
        if target.evaluate("el => el === document.activeElement"):
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"Tab never reached {selector}")


def test_an_anonymous_visitor_is_sent_to_login_and_back_to_the_health_page(
    page, operator, live_server, clean
):
    page.goto(live_server.url + HEALTH)
    assert "/admin/login/" in page.url
    assert f"next={HEALTH}" in page.url.replace("%2F", "/")
    page.fill("#id_username", USERNAME)
    page.fill("#id_password", PASSWORD)
    page.press("#id_password", "Enter")
    page.wait_for_url(re.compile(re.escape(HEALTH) + "$"))
    assert page.locator("#content h1, #content-main").first.is_visible()
    assert "Cleanup health" in page.title()


def test_the_health_page_shows_a_real_backlog_as_sql_and_the_broker_see_it(
    signed_in, live_server, clean, exclusive_workers, shots
):
    page = signed_in
    # given: 4 shards, 240 holds expired 7 minutes ago (past the 5-minute SLO), 40 more
    # expired just now, 25 release messages waiting (no worker is running), 3 open dead letters
    install_schedule(shards=4, every=3600)
    old = create_eligible_holds(240, offerings=4, expired_seconds_ago=420)
    create_eligible_holds(40, offerings=2, expired_seconds_ago=5)
    published = time.time()
    publish_release_messages(
        [ReleaseMessage.for_hold(hold, 1, timezone.now(), 0, "browser") for hold in old[:25]]
    )
    for reason in ("malformed", "malformed", "retries_exhausted"):
        DeadLetter.objects.create(reason=reason)
    for _ in range(3):  # real samples of this state feed the chart
        samples.take_sample()

    def backlog_by_sql() -> list[tuple[int, float]]:
        """(eligible holds, age of the oldest) of each shard, now."""
        return [
            sql(
                "SELECT count(*), EXTRACT(EPOCH FROM now() - min(expires_at))::float8 "
                "FROM reservations_reservation WHERE status = 'held' AND expires_at <= now() "
                "AND bucket %% 4 = %s",
                [k],
            )[0]
            for k in range(4)
        ]

    # when
    before = backlog_by_sql()
    page.goto(live_server.url + HEALTH)
    after = backlog_by_sql()
    # then: every shard's numbers are SQL's at the moment the page was made: the count, and
    # the age between the ages read just before and just after (shown to 0.1 s)
    for k in range(4):
        row = page.locator(f'tr[data-shard="{k}"]')
        eligible = int(number(row.locator('[data-metric="eligible"]').inner_text()))
        oldest = number(row.locator('[data-metric="oldest-age"]').inner_text())
        assert eligible == before[k][0] == after[k][0]
        assert before[k][1] - 0.05 <= oldest <= after[k][1] + 0.05, (k, before[k], oldest, after[k])
        state = row.locator('[data-metric="oldest-age"]').get_attribute("class") or ""
        assert "state-red" in state  # 420 s > the 300 s SLO
    assert page.inner_text("#overall-state") == "red"
    from cleanup.broker.readers import queue_depth

    assert number(page.inner_text('[data-metric="queue-depth"]')) == queue_depth("cleanup") == 25
    # the oldest message's age counts from its publish (not from the hold's expiry, 7 min ago)
    shown_age = number(page.inner_text('[data-metric="queue-age"]'))
    assert 0 <= shown_age <= time.time() - published + 1, shown_age
    assert page.inner_text('[data-metric="dead-open-malformed"]') == "2"
    assert "nobody" in page.inner_text('[data-metric="beat_lock"]')
    assert "none answered" in page.inner_text('[data-metric="workers"]')
    assert page.locator("svg.health-chart").count() == 3
    page.screenshot(path=str(shots / "health.png"), full_page=True)
    # the dead-letter link opens the filtered list
    page.click('a[data-reason="malformed"]')
    page.wait_for_url(re.compile(r"reason=malformed"))
    assert page.locator("#result_list tbody tr").count() == 2


def test_the_expired_filter_and_the_release_action_with_its_confirmation(
    signed_in, live_server, clean, exclusive_workers, shots
):
    page = signed_in
    stale = create_eligible_holds(12, offerings=2, expired_seconds_ago=120)
    page.goto(live_server.url + reverse("admin:reservations_reservation_changelist"))
    page.get_by_role("link", name="Yes").first.click()  # "By expired but still held: Yes"
    page.wait_for_url(re.compile(r"expired_held=yes"))
    rows = page.locator("#result_list tbody tr")
    assert (
        rows.count()
        == len(stale)
        == scalar(
            "SELECT count(*) FROM reservations_reservation WHERE status = 'held' "
            "AND expires_at <= now()"
        )
    )
    # a hold page, with its linked records (screenshot for the docs)
    page.locator("#result_list tbody tr th a").first.click()
    page.wait_for_selector("#hold-links")
    assert page.locator("#story").is_visible()
    page.screenshot(path=str(shots / "hold.png"), full_page=True)
    page.go_back()
    # select all on the page, choose the action, Go
    page.check("#action-toggle")
    page.select_option("select[name=action]", "release_expired_now")
    page.click("button[name=index]")
    assert "Release 12 reservations?" in page.inner_text("#confirm-summary")
    assert "12" in page.locator("#confirm-breakdown").inner_text()
    assert released_count(stale) == 0  # nothing happened yet
    page.click("#confirm-yes")
    page.wait_for_selector(".messagelist")
    assert "released: 12" in page.text_content(".messagelist").lower()
    assert released_count(stale) == 12
    audit = LogEntry.objects.filter(change_message="release expired holds now: released")
    assert audit.count() == 12


def test_requeue_shows_what_will_be_sent_and_leaves_an_audit_entry(
    signed_in, live_server, clean, exclusive_workers
):
    page = signed_in
    holds = create_eligible_holds(3, offerings=1)
    rows = sql(
        "SELECT id, version, expires_at FROM reservations_reservation WHERE id = ANY(%s) "
        "ORDER BY id",
        [holds],
    )
    letters = []
    for rid, version, expires_at in rows:
        message = build(rid, version, expires_at, 0, "browser")
        letters.append(
            DeadLetter.objects.create(
                reason="retries_exhausted",
                reservation_id=rid,
                version=version,
                idempotency_key=message["idempotency_key"],
                message=message,
            )
        )
    page.goto(live_server.url + reverse("admin:cleanup_deadletter_changelist") + "?resolved=no")
    page.check("#action-toggle")
    page.select_option("select[name=action]", "requeue")
    page.click("button[name=index]")
    summary = page.inner_text("#content-main")
    assert "Requeue 3 dead letters?" in summary
    assert "reason: retries_exhausted" in summary and "will be: republished" in summary
    assert DeadLetter.objects.filter(resolved_at__isnull=True).count() == 3
    page.click("#confirm-yes")
    page.wait_for_selector(".messagelist")
    assert "requeue: republished: 3" in page.text_content(".messagelist").lower()
    from cleanup.broker.readers import queue_depth

    assert queue_depth("cleanup") == 3
    # the audit entry, on the letter's own history page
    page.goto(live_server.url + reverse("admin:cleanup_deadletter_history", args=[letters[0].pk]))
    history = page.inner_text("#change-history")
    assert "requeue: republished" in history and USERNAME in history


def test_discarding_dead_letters_from_the_health_page_asks_why_and_leaves_history(
    signed_in, live_server, clean, shots
):
    page = signed_in
    # given: three malformed letters from a broken producer and one unknown-task letter
    malformed = [
        DeadLetter.objects.create(reason="malformed", error="not JSON", payload="{oops")
        for _ in range(3)
    ]
    other = DeadLetter.objects.create(reason="unknown_task", task_name="legacy.task")
    # when: the operator follows the health page's open count for "malformed"
    page.goto(live_server.url + HEALTH + "?workers=0")
    assert page.inner_text('[data-metric="dead-open-total"]').endswith("4 of 10000")
    page.click('[data-metric="dead-open-malformed"] a')
    page.wait_for_url(re.compile(r"reason=malformed"))
    assert page.locator("#result_list tbody tr").count() == 3
    # selects all of them and chooses "Discard"
    page.check("#action-toggle")
    page.select_option("select[name=action]", "discard")
    page.click("button[name=index]")
    # then: what it will do, and a question: why
    assert "Discard 3 dead letters?" in page.inner_text("#confirm-summary")
    breakdown = page.inner_text("#confirm-breakdown")
    assert "reason: malformed" in breakdown and "3" in breakdown
    assert DeadLetter.objects.filter(resolved_at__isnull=True).count() == 4  # nothing yet
    page.fill("#confirm-why", "a producer sent truncated JSON; fixed in its 2.4.1")
    page.screenshot(path=str(shots / "dead-letter-discard.png"), full_page=True)
    page.click("#confirm-yes")
    page.wait_for_selector(".messagelist")
    assert "discard: discarded: 3" in page.text_content(".messagelist").lower()
    for letter in malformed:
        letter.refresh_from_db()
        assert (letter.resolution, letter.resolved_by) == ("discarded", USERNAME)
    other.refresh_from_db()
    assert other.resolved_at is None
    # the letter's own history page says who and why
    page.goto(live_server.url + reverse("admin:cleanup_deadletter_history", args=[malformed[0].pk]))
    history = page.inner_text("#change-history")
    assert "discard: discarded; why: a producer sent truncated JSON" in history
    assert USERNAME in history


@pytest.mark.workers
def test_a_schedule_edit_in_the_browser_is_followed_by_a_real_beat(
    signed_in, live_server, workers, clean, tmp_path
):
    page = signed_in
    install_schedule(shards=4, every=1)
    with beats(tmp_path, 1) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat lock acquired")
        wait_until(lambda: beat.sends() >= 4, timeout=30, what="sends")
        # when: the operator disables the schedule in the admin
        page.goto(live_server.url + reverse("admin:cleanup_cleanupschedule_changelist"))
        page.uncheck("#id_enabled")
        changes = len(beat.lines("Schedule changed."))
        page.click("input[name=_save]")
        page.wait_for_selector(".messagelist")
        wait_until(lambda: len(beat.lines("Schedule changed.")) > changes, timeout=30,
                   what="beat to read the edited schedule")  # fmt: skip
        stopped_at = beat.sends()
        held = create_eligible_holds(40, offerings=2)
        # then: beat goes on ticking (it pings its lease at each tick, then sends what is due:
        # a 1 s sweep every time) for five seconds by PostgreSQL's clock, and sends no sweep
        until = scalar("SELECT now() + interval '5 seconds'")
        wait_until(lambda: (beat.lock_pinged_at() or until) > until, timeout=30,
                   what="beat to tick five seconds on")  # fmt: skip
        assert beat.sends() == stopped_at
        assert set(claim_counts(held).values()) == {0}
        # when: enabled again with 2 shards
        page.goto(live_server.url + reverse("admin:cleanup_cleanupschedule_changelist"))
        page.fill("#id_shards", "2")
        page.check("#id_enabled")
        page.click("input[name=_save]")
        page.wait_for_selector(".messagelist")
        wait_until(lambda: released_count(held) == len(held), timeout=60, what="released")
        assert any(" of 2 " in line for line in beat.lines("Sending due task"))
    schedule = CleanupSchedule.objects.get()
    assert (schedule.shards, schedule.enabled) == (2, True)


def test_the_main_actions_work_from_the_keyboard_alone(
    signed_in, live_server, clean, exclusive_workers
):
    page = signed_in
    stale = create_eligible_holds(2, offerings=1, expired_seconds_ago=60)
    # the health page's hold search: Tab to it, type, Enter
    page.goto(live_server.url + HEALTH + "?workers=0")
    tab_to(page, "#hold-id")
    page.keyboard.type(str(stale[0]))
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(rf"/reservation/{stale[0]}/change/"))
    # the release action: focus the checkboxes, Space, choose the action, Enter, confirm
    page.goto(
        live_server.url + reverse("admin:reservations_reservation_changelist") + "?expired_held=yes"
    )
    tab_to(page, "#action-toggle")
    page.keyboard.press("Space")
    tab_to(page, "select[name=action]")
    page.keyboard.type("Release")  # type-ahead picks "Release expired holds now"
    assert page.locator("select[name=action]").input_value() == "release_expired_now"
    tab_to(page, "button[name=index]")
    page.keyboard.press("Enter")
    page.wait_for_selector("#confirm-yes")
    tab_to(page, "#confirm-yes")
    page.keyboard.press("Enter")
    page.wait_for_selector(".messagelist")
    assert "released: 2" in page.text_content(".messagelist").lower()
    assert released_count(stale) == 2
    # the schedule form: Tab to "every", type, Enter saves
    install_schedule(shards=2, every=10)
    page.goto(live_server.url + reverse("admin:cleanup_cleanupschedule_changelist"))
    tab_to(page, "#id_every_seconds")
    page.keyboard.press("Control+A")
    page.keyboard.type("7")
    page.keyboard.press("Enter")
    page.wait_for_selector(".messagelist")
    assert CleanupSchedule.objects.get().every_seconds == 7
