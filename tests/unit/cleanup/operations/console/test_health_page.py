"""The operator console in the admin: the health page (numbers equal SQL and the broker), the
Cleanup schedule object, linked records, and requeue/release behind a confirmation with an
audit entry. (The same flows in a real browser: tests/integration/browser/.)"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.contrib.messages import get_messages
from django.urls import reverse
from django.utils import timezone
from django_celery_beat.models import PeriodicTask, PeriodicTasks

from cleanup.broker.readers import PEEK_ENTRIES, QueueStats
from cleanup.models import CleanupReceipt, CleanupSchedule, DeadLetter, SweepRecord
from cleanup.operations.console import health
from cleanup.release.messages import ReleaseMessage, build, idempotency_key
from cleanup.release.schedule import PRUNE_NAME, RELAY_NAME, install_schedule, sweep_entry_name
from cleanup.release.sweep import SweepResult
from common.db import rows as sql
from reservations import services
from reservations.models import Reservation
from tests.support.holds import expired_holds
from tests.support.staff import login_staff

HEALTH = "cleanup-health"
DEAD_LETTERS = "admin:cleanup_deadletter_changelist"
HOLDS = "admin:reservations_reservation_changelist"


def metric(html: str, shard: int | None, name: str) -> str:
    """The data-value of ``data-metric=name`` (inside the shard's row when ``shard`` is set)."""
    if shard is not None:
        row = re.search(rf'<tr data-shard="{shard}">(.*?)</tr>', html, re.S)
        assert row, f"no row for shard {shard}"
        html = row.group(1)
    found = re.search(rf'data-metric="{re.escape(name)}"[^>]*data-value="([^"]*)"', html)
    if found:
        return found.group(1)
    cell = re.search(rf'data-metric="{re.escape(name)}"[^>]*>(.*?)</td>', html, re.S)
    assert cell, f"no {name} on the page"
    return re.sub(r"<[^>]+>", "", cell.group(1)).strip()


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


# --- the health page --------------------------------------------------------------------------


def test_anonymous_users_are_sent_to_the_admin_login(client, db):
    response = client.get(reverse(HEALTH))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


def test_a_non_staff_user_cannot_open_the_health_page(client, db):
    user = User.objects.create_user("learner", password="x")
    client.force_login(user)
    response = client.get(reverse(HEALTH))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


def test_the_admin_index_links_to_the_health_page(root_client):
    html = root_client.get(reverse("admin:index")).content.decode()
    assert f'href="{reverse(HEALTH)}"' in html


def test_the_queue_age_says_empty_or_not_observable_rather_than_a_bare_dash(
    root_client, broker, monkeypatch
):
    # given: an empty release queue on Redis
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    # then
    assert metric(html, None, "queue-age") == "— (empty)"
    # given: messages waiting on a broker that cannot show their age (RabbitMQ: no peek)
    waiting = QueueStats("cleanup", depth=5, oldest_age_seconds=None, unacked=None)
    monkeypatch.setattr(health, "queue_stats", lambda queue: waiting)
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    # then: the page says why there is no number, and where to look instead
    assert metric(html, None, "queue-depth") == "5"
    assert metric(html, None, "queue-age").startswith("— (not observable on this broker")
    assert "oldest eligible hold" in metric(html, None, "queue-age")


def test_the_queue_age_says_unreadable_when_the_oldest_entries_on_redis_are(root_client, broker):
    # given: the release queue's oldest entries on Redis are all planted garbage
    broker.rpush("cleanup", *([b"not json"] * PEEK_ENTRIES))
    # when
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    # then: not "empty", not "RabbitMQ has no peek"
    assert metric(html, None, "queue-depth") == str(PEEK_ENTRIES)
    assert metric(html, None, "queue-age").startswith(
        f"— (the oldest waiting entries are unreadable: {PEEK_ENTRIES} skipped"
    )


def test_the_health_page_numbers_equal_sql_and_the_broker(root_client, broker, make_offering):
    # given: a backlog in a 4-shard schedule, messages waiting, dead letters, receipts
    install_schedule(shards=4, every=10)
    offering = make_offering(capacity=60)
    expired_holds(30, offering_id=offering.pk, ago=timedelta(seconds=400))
    services.hold_seat(offering.pk, "still-valid", ttl_seconds=600)
    letters = [
        DeadLetter.objects.create(reason=DeadLetter.Reason.MALFORMED),
        DeadLetter.objects.create(reason=DeadLetter.Reason.MALFORMED),
        DeadLetter.objects.create(reason=DeadLetter.Reason.RETRIES_EXHAUSTED),
    ]
    DeadLetter.objects.filter(pk=letters[2].pk).update(resolved_at="2026-01-01T00:00Z")
    CleanupReceipt.objects.create(
        idempotency_key="release:1:1", reservation_id=1, version=1, outcome="released", attempt=3
    )
    CleanupReceipt.objects.create(
        idempotency_key="release:2:1", reservation_id=2, version=1, outcome="renewed"
    )
    from cleanup.release.publish import publish_release_messages

    publish_release_messages(
        [ReleaseMessage.for_hold(900_000 + i, 1, timezone.now(), 0, "t") for i in range(7)]
    )
    # when
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    # then: per shard, what SQL says (an independent statement: bucket % N)
    for k in range(4):
        n, oldest = sql(
            "SELECT count(*), EXTRACT(EPOCH FROM now() - min(expires_at)) "
            "FROM reservations_reservation WHERE status = 'held' AND expires_at <= now() "
            "AND bucket %% 4 = %s",
            [k],
        )[0]
        assert int(metric(html, k, "eligible")) == n
        if n:
            assert abs(float(metric(html, k, "oldest-age")) - float(oldest)) < 5
        else:
            assert float(metric(html, k, "oldest-age")) == 0.0
    total = sum(int(metric(html, k, "eligible")) for k in range(4))
    assert total == 30
    # the broker's own answer for the release queue
    depth = sum(broker.llen(key) for key in broker.keys("cleanup*") if broker.type(key) == b"list")
    assert int(metric(html, None, "queue-depth")) == depth == 7
    # open dead letters by reason, linking to the filtered list
    assert metric(html, None, "dead-open-malformed") == "2"
    assert "dead-open-retries_exhausted" not in html
    assert f"{reverse(DEAD_LETTERS)}?reason=malformed&amp;resolved=no" in html
    # outcomes and retries from receipts
    assert metric(html, None, "transitions-5") == "1"
    assert metric(html, None, "retries-60") == "2"
    assert metric(html, None, "outcome-renewed-60") == "1"
    assert metric(html, None, "outcome-released-5") == "1"
    assert metric(html, None, "lease").startswith("nobody")


def test_an_old_backlog_shows_red_and_a_capped_count_says_so(
    root_client, broker, make_offering, settings
):
    settings.CLEANUP_ELIGIBLE_COUNT_CAP = 5
    settings.CLEANUP_SLO_SECONDS = 300
    install_schedule(shards=1, every=10)
    expired_holds(8, offering_id=make_offering(capacity=20).pk, ago=timedelta(seconds=900))
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    assert metric(html, 0, "eligible") == "5"
    assert "capped at 5" in html
    assert 'class="state state-red" id="overall-state"' in html


def test_the_last_sweep_of_each_shard_is_shown(root_client, broker):
    install_schedule(shards=2, every=10)
    result = SweepResult(1, 2, "trace-x", claimed=12, published=11, backpressure=True)
    health.record_sweep(result)
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    assert metric(html, 1, "claimed") == "12"
    assert metric(html, 1, "published") == "11"
    assert metric(html, 1, "backpressure").startswith("yes")
    assert SweepRecord.objects.get(shard=1).published == 11


# A page that waited for an answer that never comes would be stuck: this test's own deadline
# (pytest-timeout) fails it, with no timed assertion.
@pytest.mark.timeout(60)
def test_the_worker_ping_is_bounded_when_no_worker_answers(root_client, broker):
    html = root_client.get(reverse(HEALTH)).content.decode()
    assert "none answered" in html


def test_samples_feed_the_chart_and_are_pruned_after_a_day(root_client, broker, make_offering):
    from datetime import timedelta

    from django.utils import timezone

    from cleanup.models import HealthSample

    install_schedule(shards=2, every=10)
    expired_holds(3, offering_id=make_offering(capacity=5).pk, ago=timedelta(seconds=120))
    sample = health.take_sample()
    assert sample.eligible == 3
    assert 110 < sample.oldest_eligible_age_seconds < 200
    assert sample.queue_depth == 0
    html = root_client.get(reverse(HEALTH) + "?workers=0").content.decode()
    assert "Last hour (1 samples)" in html
    assert html.count('class="health-chart"') == 3
    old = HealthSample.objects.create(
        taken_at=timezone.now() - timedelta(days=2),
        oldest_eligible_age_seconds=0,
        eligible=0,
        released_last_minute=0,
    )
    assert health.prune_samples() == 1
    assert not HealthSample.objects.filter(pk=old.pk).exists()


def test_searching_a_hold_id_on_the_health_page_opens_the_hold(root_client, offering):
    hold = services.hold_seat(offering.pk, "someone", ttl_seconds=60)
    response = root_client.get(reverse(HEALTH) + f"?hold={hold.pk}&workers=0")
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:reservations_reservation_change", args=[hold.pk])
    missing = root_client.get(reverse(HEALTH) + "?hold=999999&workers=0", follow=True)
    assert "No hold with id" in missing.content.decode()


# --- the Cleanup schedule ---------------------------------------------------------------------


def test_saving_the_cleanup_schedule_in_the_admin_rewrites_the_sweep_entries(root_client):
    install_schedule(shards=4, every=10)
    schedule = CleanupSchedule.objects.get()
    url = reverse("admin:cleanup_cleanupschedule_change", args=[schedule.pk])
    # the list page goes straight to the one object
    assert root_client.get(reverse("admin:cleanup_cleanupschedule_changelist"))["Location"] == url
    # when
    response = root_client.post(
        url, {"shards": "3", "every_seconds": "2", "enabled": ""}, follow=True
    )
    # then
    assert response.status_code == 200
    entries = PeriodicTask.objects.filter(name__startswith="cleanup: sweep").order_by("name")
    assert [e.name for e in entries] == [sweep_entry_name(k, 3) for k in range(3)]
    assert {(e.interval.every, e.enabled, e.expire_seconds) for e in entries} == {(2, False, 2)}
    assert [json.loads(e.kwargs)["shard"] for e in entries] == [0, 1, 2]
    assert any("Beat follows" in m for m in messages_of(response))


def test_an_invalid_schedule_is_refused_and_nothing_changes(root_client):
    install_schedule(shards=4, every=10)
    schedule = CleanupSchedule.objects.get()
    url = reverse("admin:cleanup_cleanupschedule_change", args=[schedule.pk])
    response = root_client.post(url, {"shards": "0", "every_seconds": "10", "enabled": "on"})
    assert response.status_code == 200  # the form again, with an error
    assert "errornote" in response.content.decode()
    assert PeriodicTask.objects.filter(name__startswith="cleanup: sweep").count() == 4


def test_managed_entries_are_read_only_in_beats_admin_and_others_stay_editable(root_client):
    install_schedule(shards=2, every=10)
    managed = PeriodicTask.objects.get(name=sweep_entry_name(0, 2))
    other = PeriodicTask.objects.get(name=RELAY_NAME)
    page = root_client.get(
        reverse("admin:django_celery_beat_periodictask_change", args=[managed.pk])
    )
    html = page.content.decode()
    assert "Managed by the Cleanup schedule" in html
    assert 'name="_save"' not in html
    # a hand-made POST is refused too
    refused = root_client.post(
        reverse("admin:django_celery_beat_periodictask_change", args=[managed.pk]),
        {"name": managed.name, "task": managed.task, "enabled": ""},
    )
    assert refused.status_code == 403
    # bulk disable leaves the managed entries alone
    response = root_client.post(
        reverse("admin:django_celery_beat_periodictask_changelist"),
        {"action": "disable_tasks", "_selected_action": [managed.pk, other.pk], "index": 0},
        follow=True,
    )
    assert any("left unchanged" in m for m in messages_of(response))
    managed.refresh_from_db()
    other.refresh_from_db()
    assert managed.enabled is True
    assert other.enabled is False
    editable = root_client.get(
        reverse("admin:django_celery_beat_periodictask_change", args=[other.pk])
    )
    assert 'name="_save"' in editable.content.decode()


# --- django-celery-beat's actions: change permission, history ---------------------------------

PERIODIC_TASKS = "admin:django_celery_beat_periodictask_changelist"
BEAT_ACTIONS = ("enable_tasks", "disable_tasks", "toggle_tasks", "run_tasks")


def _two_unmanaged_tasks() -> list[PeriodicTask]:
    """The relay (enabled) and the prune (disabled), both on the maintenance queue."""
    install_schedule(shards=2, every=10)
    PeriodicTask.objects.filter(name=PRUNE_NAME).update(enabled=False)
    return list(PeriodicTask.objects.filter(name__in=[RELAY_NAME, PRUNE_NAME]).order_by("pk"))


def _state(tasks: list[PeriodicTask]) -> dict[str, bool]:
    return dict(
        PeriodicTask.objects.filter(pk__in=[t.pk for t in tasks]).values_list("name", "enabled")
    )


def _run_action(client: Any, action: str, tasks: list[PeriodicTask]) -> Any:
    """Post a bulk action of the periodic tasks' list on ``tasks``, as its form does."""
    return client.post(
        reverse(PERIODIC_TASKS),
        {"action": action, "_selected_action": [t.pk for t in tasks], "index": 0},
        follow=True,
    )


def _queued(broker: Any, tasks: list[PeriodicTask]) -> int:
    return sum(int(broker.llen(q)) for q in {t.queue for t in tasks})


@pytest.mark.parametrize("action", BEAT_ACTIONS)
def test_a_periodic_task_viewer_is_offered_no_beat_action_and_a_forged_post_does_nothing(
    db, broker, action
):
    tasks = _two_unmanaged_tasks()
    before = _state(tasks)
    viewer = login_staff("viewer", "view_periodictask", app_label="django_celery_beat")
    page = viewer.get(reverse(PERIODIC_TASKS))
    assert page.status_code == 200
    html = page.content.decode()
    assert RELAY_NAME in html  # the viewer does see the list
    for name in BEAT_ACTIONS:
        assert f'value="{name}"' not in html
    forged = _run_action(viewer, action, tasks)
    assert forged.status_code == 200
    assert _state(tasks) == before
    assert _queued(broker, tasks) == 0
    assert not LogEntry.objects.exists()


def _both(message: str) -> dict[str, str]:
    return {RELAY_NAME: message, PRUNE_NAME: message}


@pytest.mark.parametrize(
    ("action", "after", "history"),
    [
        (
            "enable_tasks",
            {RELAY_NAME: True, PRUNE_NAME: True},
            _both("enable selected tasks: enabled"),
        ),
        (
            "disable_tasks",
            {RELAY_NAME: False, PRUNE_NAME: False},
            _both("disable selected tasks: disabled"),
        ),
        (  # each row's history says the state the toggle left it in
            "toggle_tasks",
            {RELAY_NAME: False, PRUNE_NAME: True},
            {
                RELAY_NAME: "toggle selected tasks: disabled",
                PRUNE_NAME: "toggle selected tasks: enabled",
            },
        ),
        ("run_tasks", {RELAY_NAME: True, PRUNE_NAME: False}, _both("run selected tasks: sent")),
    ],
)
def test_a_user_who_may_change_periodic_tasks_runs_each_beat_action_and_each_row_is_logged(
    db, broker, action, after, history
):
    tasks = _two_unmanaged_tasks()
    marker = PeriodicTasks.last_change()
    editor = login_staff(
        "editor", "view_periodictask", "change_periodictask", app_label="django_celery_beat"
    )
    page = editor.get(reverse(PERIODIC_TASKS))
    assert f'value="{action}"' in page.content.decode()
    done = _run_action(editor, action, tasks)
    assert done.status_code == 200
    assert _state(tasks) == after
    editor_id = User.objects.get(username="editor").pk
    logged = {
        (int(e.object_id), e.user_id, e.get_change_message())
        for e in LogEntry.objects.filter(content_type__app_label="django_celery_beat")
    }
    assert logged == {(t.pk, editor_id, history[t.name]) for t in tasks}
    assert LogEntry.objects.count() == len(tasks)
    if action == "run_tasks":
        assert _queued(broker, tasks) == 2
    else:  # beat re-reads the schedule when this marker moves
        assert PeriodicTasks.last_change() != marker


# --- linked records ---------------------------------------------------------------------------


def test_hold_receipt_and_dead_letter_pages_link_to_each_other(root_client, broker, offering):
    hold = services.hold_seat(offering.pk, "linked", ttl_seconds=60)
    key = idempotency_key(hold.pk, hold.version)
    receipt = CleanupReceipt.objects.create(
        idempotency_key=key, reservation_id=hold.pk, version=hold.version, outcome="renewed"
    )
    letter = DeadLetter.objects.create(
        reason=DeadLetter.Reason.FAILED,
        reservation_id=hold.pk,
        version=hold.version,
        idempotency_key=key,
        delivery_count=4,
    )
    from cleanup.release import delivery_cap

    delivery_cap.increment(key)
    delivery_cap.increment(key)
    hold_url = reverse("admin:reservations_reservation_change", args=[hold.pk])
    receipt_url = reverse("admin:cleanup_cleanupreceipt_change", args=[receipt.pk])
    letter_url = reverse("admin:cleanup_deadletter_change", args=[letter.pk])
    # the hold page
    html = root_client.get(hold_url).content.decode()
    assert f"{reverse('admin:cleanup_cleanupreceipt_changelist')}?reservation_id={hold.pk}" in html
    assert f"{reverse(DEAD_LETTERS)}?reservation_id={hold.pk}" in html
    assert "1 dead letter(s), 1 open" in html
    assert 'href="#story"' in html and 'id="story"' in html
    assert f"2 redeliveries, 3 deliveries (counter for {key})" in html
    # the filtered lists those links open
    listed = root_client.get(f"{reverse(DEAD_LETTERS)}?reservation_id={hold.pk}")
    assert [o.pk for o in listed.context["cl"].result_list] == [letter.pk]
    # the receipt page links its hold and shows the delivery count
    html = root_client.get(receipt_url).content.decode()
    assert f'href="{hold_url}"' in html
    assert f"2 redeliveries, 3 deliveries (counter for {key})" in html
    # the dead letter page links its hold and its receipt
    html = root_client.get(letter_url).content.decode()
    assert f'href="{hold_url}"' in html
    assert f'href="{receipt_url}"' in html


# --- requeue and release, guarded -------------------------------------------------------------


def _letter(reservation_id: int, version: int, expires_at: Any, reason: str) -> DeadLetter:
    message = build(reservation_id, version, expires_at, 0, "trace")
    return DeadLetter.objects.create(
        reason=reason,
        reservation_id=reservation_id,
        version=version,
        idempotency_key=message["idempotency_key"],
        message=message,
    )


def test_requeue_shows_what_will_be_sent_then_sends_and_audits(root_client, broker, offering):
    holds = [services.hold_seat(offering.pk, f"h{i}", ttl_seconds=60) for i in range(3)]
    letters = [
        _letter(h.pk, h.version, h.expires_at, DeadLetter.Reason.RETRIES_EXHAUSTED)
        for h in holds[:2]
    ] + [_letter(holds[2].pk, holds[2].version, holds[2].expires_at, DeadLetter.Reason.FAILED)]
    ids = [letter.pk for letter in letters]
    # when: the action is chosen
    page = root_client.post(
        reverse(DEAD_LETTERS), {"action": "requeue", "_selected_action": ids, "index": 0}
    )
    # then: a confirmation, and nothing sent or resolved yet
    html = page.content.decode()
    assert "Requeue 3 dead letters?" in html
    assert "reason: retries_exhausted" in html and "reason: failed" in html
    assert "will be: republished" in html
    assert all(f"#{pk}" in html for pk in ids)
    assert DeadLetter.objects.filter(resolved_at__isnull=True).count() == 3
    assert not LogEntry.objects.exists()
    # when: confirmed
    done = root_client.post(
        reverse(DEAD_LETTERS),
        {"action": "requeue", "_selected_action": ids, "index": 0, "confirm": "yes"},
        follow=True,
    )
    # then
    assert "Requeue: republished: 3" in messages_of(done)
    assert DeadLetter.objects.filter(resolution="republished").count() == 3
    # object_id is a text column: the entries are put in order by the number it holds
    logged = sorted(
        (int(e.object_id), e.get_change_message(), str(e.user)) for e in LogEntry.objects.all()
    )
    assert logged == [(pk, "requeue: republished", "root") for pk in sorted(ids)]
    # when: confirmed again (a second operator, a double click): nothing is sent twice
    again = root_client.post(
        reverse(DEAD_LETTERS),
        {"action": "requeue", "_selected_action": ids, "index": 0, "confirm": "yes"},
        follow=True,
    )
    assert "Requeue: already_resolved: 3" in messages_of(again)


def test_requeue_all_matching_the_filter_is_bounded_and_says_how_many(
    root_client, broker, offering, monkeypatch
):
    from cleanup import admin as cleanup_admin

    monkeypatch.setattr(cleanup_admin, "REQUEUE_LIMIT", 2)
    hold = services.hold_seat(offering.pk, "x", ttl_seconds=60)
    for _ in range(5):
        _letter(hold.pk, hold.version, hold.expires_at, DeadLetter.Reason.MALFORMED)
    page = root_client.post(
        reverse(DEAD_LETTERS) + "?reason=malformed",
        {"action": "requeue", "_selected_action": ["1"], "index": 0, "select_across": "1"},
    )
    html = page.content.decode()
    assert "5 match the current filter: only the first 2" in html
    first_two = DeadLetter.objects.order_by("pk").values_list("pk", flat=True)[:2]
    assert f'name="confirm_ids" value="{first_two[0]},{first_two[1]}"' in html
    # confirmed: only those two are acted on, though five match
    done = root_client.post(
        reverse(DEAD_LETTERS) + "?reason=malformed",
        {
            "action": "requeue",
            "_selected_action": [str(first_two[0])],
            "index": 0,
            "select_across": "1",
            "confirm": "yes",
            "confirm_ids": f"{first_two[0]},{first_two[1]}",
        },
        follow=True,
    )
    assert messages_of(done) == ["Requeue: republished: 2"]
    assert DeadLetter.objects.filter(resolved_at__isnull=True).count() == 3


def test_release_now_asks_first_then_releases_and_audits(root_client, offering):
    stale = expired_holds(2, offering_id=offering.pk, ago=timedelta(seconds=300))
    live = services.hold_seat(offering.pk, "live", ttl_seconds=600)
    ids = [*stale, live.pk]
    page = root_client.post(
        reverse(HOLDS), {"action": "release_expired_now", "_selected_action": ids, "index": 0}
    )
    html = page.content.decode()
    assert "Release 3 reservations?" in html
    assert re.search(r"expired and still held: will be released</td><td[^>]*>2<", html)
    assert Reservation.objects.filter(status="held").count() == 3
    done = root_client.post(
        reverse(HOLDS),
        {"action": "release_expired_now", "_selected_action": ids, "index": 0, "confirm": "yes"},
        follow=True,
    )
    assert "released: 2, not_expired: 1" in messages_of(done)
    messages = {int(e.object_id): e.get_change_message() for e in LogEntry.objects.all()}
    assert messages == {
        stale[0]: "release expired holds now: released",
        stale[1]: "release expired holds now: released",
        live.pk: "release expired holds now: not_expired",
    }
