"""The cleanup's admin (cleanup.admin): dead letters (discard and requeue behind a confirmation,
audited, bounded, filtered by task and age), the Cleanup schedule object and beat's periodic
tasks, the records linked from a hold, and the hold's story on its page."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import IntervalSchedule, PeriodicTask, PeriodicTasks
from kombu.exceptions import OperationalError

from cleanup.models import CleanupReceipt, CleanupSchedule, DeadLetter
from cleanup.operations import triage
from cleanup.release.messages import build, idempotency_key
from cleanup.release.publish import publish_release_messages
from cleanup.release.schedule import PRUNE_NAME, RELAY_NAME, install_schedule, sweep_entry_name
from reservations import services
from reservations.models import Offering
from tests.support.dead_letters import MALFORMED, UNKNOWN, history, is_open, letter
from tests.support.staff import login_staff, messages_of

DEAD_LETTERS = "admin:cleanup_deadletter_changelist"


def post_action(client: Client, action: str, ids: list[int], url: str = "", **extra: Any) -> Any:
    return client.post(
        url or reverse(DEAD_LETTERS),
        {"action": action, "_selected_action": ids, "index": 0, **extra},
        follow=True,
    )


def confirm(client: Client, page: Any, **fields: str) -> Any:
    """Post the confirmation page's form as it is, with ``fields`` filled in."""
    html = page.content.decode()
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', html))
    form.pop("csrfmiddlewaretoken", None)
    action_url = re.search(r'<form method="post" action="([^"]+)">', html)
    assert action_url, "no confirmation form"
    return client.post(action_url.group(1).replace("&amp;", "&"), {**form, **fields}, follow=True)


# --- dead letters: discard and requeue behind a confirmation ----------------------------------


def test_discard_asks_first_showing_how_many_by_reason_and_why_then_discards_and_audits(db):
    operator = login_staff("frank", "view_deadletter", "change_deadletter", app_label="cleanup")
    letters = [letter(MALFORMED), letter(MALFORMED), letter(UNKNOWN, "x")]
    ids = [x.pk for x in letters]
    # when: the action is chosen
    page = post_action(operator, "discard", ids)
    # then: a confirmation page, and nothing done yet
    html = page.content.decode()
    assert "Discard 3 dead letters?" in html and "Nothing has been done yet." in html
    assert 'reason: malformed</td><td class="count">2' in html
    assert 'reason: unknown_task</td><td class="count">1' in html
    assert "Why are they discarded?" in html and 'name="why"' in html
    assert all(is_open(*letters))
    # when: confirmed without a reason: the page again, saying why, nothing done
    again = confirm(operator, page, why="  ")
    assert "Say why these letters are discarded" in again.content.decode()
    assert "Discard 3 dead letters?" in again.content.decode()
    assert all(is_open(*letters)) and not LogEntry.objects.exists()
    # when: confirmed with one
    done = confirm(operator, again, why="fuzzing from the load test")
    assert "Discard: discarded: 3" in messages_of(done)
    for x in letters:
        x.refresh_from_db()
        assert (x.resolution, x.resolved_by, x.resolution_note) == (
            "discarded",
            "frank",
            "fuzzing from the load test",
        )
        assert history(x.pk) == [("frank", "discard: discarded; why: fuzzing from the load test")]


def test_a_dead_letter_viewer_is_offered_no_discard_and_a_forged_post_changes_nothing(db):
    viewer = login_staff("gina", "view_deadletter", app_label="cleanup")
    x = letter()
    page = viewer.get(reverse(DEAD_LETTERS))
    html = page.content.decode()
    assert page.status_code == 200
    assert reverse("admin:cleanup_deadletter_change", args=[x.pk]) in html  # the list is shown
    assert 'value="discard"' not in html and 'value="requeue"' not in html
    forged = post_action(
        viewer,
        "discard",
        [x.pk],
        confirm="yes",
        confirm_ids=str(x.pk),
        select_across="1",
        why="because",
    )
    assert forged.status_code == 200
    assert is_open(x) == [True]
    assert not LogEntry.objects.exists()


def test_discard_all_matching_a_filter_confirms_more_letters_than_djangos_field_limit(db):
    # 1,005 malformed letters: more ids than DATA_UPLOAD_MAX_NUMBER_FIELDS (1,000) form fields
    DeadLetter.objects.bulk_create([DeadLetter(reason=MALFORMED) for _ in range(1005)])
    other = letter(UNKNOWN, "x")
    operator = login_staff("hal", "view_deadletter", "change_deadletter", app_label="cleanup")
    url = reverse(DEAD_LETTERS) + "?reason=malformed&resolved=no"
    first = DeadLetter.objects.filter(reason=MALFORMED).order_by("pk").first()
    assert first is not None
    page = post_action(operator, "discard", [first.pk], url=url, select_across="1")
    assert "Discard 1005 dead letters?" in page.content.decode()
    done = confirm(operator, page, why="a producer bug, fixed")
    assert done.status_code == 200
    assert "Discard: discarded: 1005" in messages_of(done)
    assert DeadLetter.objects.filter(reason=MALFORMED, resolution="discarded").count() == 1005
    assert is_open(other) == [True]
    assert LogEntry.objects.count() == 1005


def test_requeue_of_a_thousand_letters_can_be_confirmed(root_client, broker):
    # The requeue bound is 1,000: its confirmation used to post one form field per id, which
    # Django refuses (400) above DATA_UPLOAD_MAX_NUMBER_FIELDS.
    DeadLetter.objects.bulk_create([DeadLetter(reason=MALFORMED) for _ in range(1001)])
    client = root_client
    url = reverse(DEAD_LETTERS) + "?reason=malformed"
    first = DeadLetter.objects.order_by("pk").values_list("pk", flat=True)[0]
    page = post_action(client, "requeue", [first], url=url, select_across="1")
    assert "Requeue 1000 dead letters?" in page.content.decode()
    done = confirm(client, page)
    assert done.status_code == 200
    assert any("not_requeueable (" in m and ": 1000" in m for m in messages_of(done))


def test_the_task_and_age_filters_narrow_the_list_and_a_bad_age_says_why(root_client):
    client = root_client
    old = letter(UNKNOWN, "evil.task", age=timedelta(days=2))
    new = letter(UNKNOWN, "evil.task")
    other = letter(UNKNOWN, "other.task", age=timedelta(days=2))

    def listed(query: str) -> set[int]:
        page = client.get(reverse(DEAD_LETTERS) + query)
        assert page.status_code == 200
        return {
            int(pk)
            for pk in re.findall(r'name="_selected_action" value="(\d+)"', page.content.decode())
        }

    assert listed("?task_name=evil.task") == {old.pk, new.pk}
    assert listed("?task_name=evil.task&older_than=1d") == {old.pk}
    assert listed("?older_than=1d") == {old.pk, other.pk}
    page = client.get(reverse(DEAD_LETTERS) + "?older_than=soon", follow=True)
    assert any("'soon' is not an age" in m for m in messages_of(page))
    assert "evil.task" in client.get(reverse(DEAD_LETTERS)).content.decode()  # offered


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


def _both(message: str) -> dict[str, str]:
    return {RELAY_NAME: message, PRUNE_NAME: message}


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


def test_run_selected_tasks_does_not_send_a_row_the_form_would_refuse(db, broker):
    # given: Celery's built-in every 1 µs onto the release queue, written past the form
    every_us, _ = IntervalSchedule.objects.get_or_create(
        every=1, period=IntervalSchedule.MICROSECONDS
    )
    planted = PeriodicTask.objects.create(
        name="planted", task="celery.backend_cleanup", interval=every_us, queue="cleanup"
    )
    editor = login_staff(
        "editor", "view_periodictask", "change_periodictask", app_label="django_celery_beat"
    )
    # when: a user who may change periodic tasks runs it from the list
    done = _run_action(editor, "run_tasks", [planted])
    # then: nothing is sent, and the page says why
    assert _queued(broker, [planted]) == 0
    assert any(
        m.startswith("planted not sent: 'celery.backend_cleanup' is not one of this project")
        for m in messages_of(done)
    ), messages_of(done)
    assert not LogEntry.objects.exists()


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


# --- requeue, guarded -------------------------------------------------------------------------


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


def test_a_failed_send_stops_the_requeue_and_says_what_stays_open(
    root_client, broker, offering, monkeypatch
):
    # given: three letters, and a broker that takes the first message and then refuses
    holds = [services.hold_seat(offering.pk, f"h{i}", ttl_seconds=60) for i in range(3)]
    ids = [
        _letter(h.pk, h.version, h.expires_at, DeadLetter.Reason.RETRIES_EXHAUSTED).pk
        for h in holds
    ]
    sends: list[int] = []

    def refused_after_one(messages: Any) -> None:
        sends.append(len(messages))
        if len(sends) > 1:
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        publish_release_messages(messages)

    monkeypatch.setattr(triage, "publish_release_messages", refused_after_one)
    # when: confirmed
    done = root_client.post(
        reverse(DEAD_LETTERS),
        {"action": "requeue", "_selected_action": ids, "index": 0, "confirm": "yes"},
        follow=True,
    )
    # then: one sent, the second failed, the third never tried; the page says so
    assert sends == [1, 1]
    (said,) = messages_of(done)
    assert said.startswith("Requeue: error: 1, not_tried: 1, republished: 1. A send failed")
    assert "that letter and the 1 after it stay open" in said
    assert list(DeadLetter.objects.order_by("pk").values_list("resolution", flat=True)) == [
        "republished",
        "",
        "",
    ]


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


# --- the hold's story -------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("broker")
def test_admin_hold_page_shows_the_story(offering: Offering, admin_client: Client) -> None:
    hold = services.hold_seat(offering.pk, "gus", ttl_seconds=60)
    page = admin_client.get(f"/admin/reservations/reservation/{hold.pk}/change/")
    assert page.status_code == 200
    assert b"Story (explain_hold)" in page.content
    assert b"verdict: held, not expired until" in page.content
