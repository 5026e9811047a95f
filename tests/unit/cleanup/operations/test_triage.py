"""Dead-letter triage: discard (service, command, admin action), requeue's command conventions
(dry run, progress, summary, exit code, --limit), the open-letter cap and its summaries,
retention, the cap gauge, the health page's links, and the settings checked at start-up.
(The discard action in a real browser: tests/integration/browser/.)"""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.contrib.messages import get_messages
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from cleanup.broker.readers import queue_depth
from cleanup.models import CleanupReceipt, DeadLetter
from cleanup.operations import triage
from cleanup.release import dead_letters, outbox
from cleanup.release.messages import build
from tests.support import ROOT
from tests.support.child_python import run_with
from tests.support.fleet import service_env
from tests.support.staff import login_staff

DEAD_LETTERS = "admin:cleanup_deadletter_changelist"
MALFORMED = DeadLetter.Reason.MALFORMED
UNKNOWN = DeadLetter.Reason.UNKNOWN_TASK


def letter(reason: str = MALFORMED, task: str = "", age: timedelta | None = None) -> DeadLetter:
    made = DeadLetter.objects.create(
        reason=reason, task_name=task, error="boom", payload="x" * 2000
    )
    if age is not None:
        DeadLetter.objects.filter(pk=made.pk).update(created_at=timezone.now() - age)
        made.refresh_from_db()
    return made


def requeueable(reservation_id: int) -> DeadLetter:
    message = build(reservation_id, 1, timezone.now(), 0, "triage")
    return DeadLetter.objects.create(
        reason=DeadLetter.Reason.RETRIES_EXHAUSTED,
        task_name="cleanup.release_reservation",
        reservation_id=reservation_id,
        version=1,
        idempotency_key=message["idempotency_key"],
        message=message,
    )


def history(pk: int) -> list[tuple[str, str]]:
    return [
        (str(e.user), e.get_change_message())
        for e in LogEntry.objects.filter(
            content_type__model="deadletter", object_id=str(pk)
        ).order_by("pk")
    ]


def run(command: str, *args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(command, *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def is_open(*letters: DeadLetter) -> list[bool]:
    return [
        DeadLetter.objects.get(pk=x.pk).resolved_at is None
        for x in sorted(letters, key=lambda x: x.pk)
    ]


# --- the services ------------------------------------------------------------------------------


def test_discard_resolves_each_open_letter_once_with_who_and_why(db):
    first, second = letter(), letter(UNKNOWN, "evil.task")
    done = triage.discard([first, second], by="alice", why="  garbage from a test client ")
    assert sorted(done) == ["discarded"]
    for x in (first, second):
        x.refresh_from_db()
        assert x.resolved_at is not None
        assert (x.resolution, x.resolved_by, x.resolution_note) == (
            "discarded",
            "alice",
            "garbage from a test client",
        )
    # a second discard (another operator, a double click) changes nothing
    again = triage.discard([first], by="bob", why="me too")
    assert {k: [x.pk for x in v] for k, v in again.items()} == {"already_resolved": [first.pk]}
    first.refresh_from_db()
    assert first.resolved_by == "alice"


@pytest.mark.parametrize(
    ("why", "words"), [("", "say why"), ("   ", "say why"), ("x" * 501, "at most 500")]
)
def test_discard_needs_a_reason_of_at_most_500_characters(db, why, words):
    x = letter()
    with pytest.raises(ValueError, match=words):
        triage.discard([x], by="alice", why=why)
    assert is_open(x) == [True]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("6h", 21600), ("7d", 604800), ("2w", 1209600)],
)
def test_ages_are_a_number_and_a_unit(text, seconds):
    assert triage.parse_age(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "7", "d", "-1d", "0h", "1y", "1.5h"])
def test_anything_else_is_not_an_age_and_the_message_says_what_is(text):
    with pytest.raises(ValueError, match="a positive number and a unit, s, m, h, d or w"):
        triage.parse_age(text)


def test_the_oldest_open_letters_beyond_the_cap_are_summarised_per_reason_and_task(db):
    # given: 8 malformed letters (task a), 3 unknown_task (task x), 2 claims_exhausted, cap 5
    old_malformed = [letter(MALFORMED, "a") for _ in range(6)]
    old_unknown = [letter(UNKNOWN, "x") for _ in range(2)]
    set_aside = [letter(DeadLetter.Reason.CLAIMS_EXHAUSTED) for _ in range(2)]
    kept = [letter(MALFORMED, "a"), letter(MALFORMED, "a"), letter(UNKNOWN, "x")]
    kept += [letter(UNKNOWN, "y"), letter(UNKNOWN, "y")]
    # when
    assert dead_letters.summarise_beyond_cap(5) == 8
    # then: the 5 newest candidates and the claims_exhausted letters stay open in full
    assert all(is_open(*kept, *set_aside))
    assert DeadLetter.objects.get(pk=kept[0].pk).payload == "x" * 2000
    # the 8 older ones are resolved as summarised, their payloads dropped
    for x in (*old_malformed, *old_unknown):
        x.refresh_from_db()
        assert (x.resolution, x.resolved_by, x.payload, x.message) == (
            "summarised",
            "cleanup",
            "",
            None,
        )
    # one open summary letter per reason and task, with the count and first/last times
    summaries = DeadLetter.objects.filter(summarised_count__gt=0, resolved_at__isnull=True)
    got = {
        (s.reason, s.task_name): (s.summarised_count, s.summarised_first_at, s.summarised_last_at)
        for s in summaries
    }
    assert got == {
        (MALFORMED, "a"): (6, old_malformed[0].created_at, old_malformed[-1].created_at),
        (UNKNOWN, "x"): (2, old_unknown[0].created_at, old_unknown[-1].created_at),
    }
    summary = summaries.get(reason=MALFORMED)
    assert "summary of 6 older open dead letter(s)" in summary.error
    assert f"summarised into dead letter #{summary.pk}" in old_malformed[0].resolution_note
    # nothing more to do; later letters beyond the cap go into the same summary
    assert dead_letters.summarise_beyond_cap(5) == 0
    letter(MALFORMED, "a")
    assert dead_letters.summarise_beyond_cap(5) == 1
    summary.refresh_from_db()
    assert summary.summarised_count == 7
    assert summaries.count() == 2


def test_the_health_upkeep_every_30_s_applies_the_cap(db, broker, settings):
    from cleanup.tasks import sample_health_task

    settings.CLEANUP_DEAD_LETTER_OPEN_CAP = 2
    letters = [letter() for _ in range(4)]
    result = sample_health_task.run()  # the task's body, as the worker runs it
    assert result["dead_letters_summarised"] == 2
    assert is_open(*letters) == [False, False, True, True]


def test_task_names_beyond_the_bound_per_reason_share_one_summary(db, monkeypatch):
    monkeypatch.setattr(dead_letters, "SUMMARY_TASKS_PER_REASON", 2)
    for task, n in (("t1", 3), ("t2", 2), ("t3", 1), ("t4", 1)):
        for _ in range(n):
            letter(UNKNOWN, task)
    letter(UNKNOWN, "newest")
    assert dead_letters.summarise_beyond_cap(1) == 7
    got = dict(
        DeadLetter.objects.filter(summarised_count__gt=0).values_list(
            "task_name", "summarised_count"
        )
    )
    assert got == {"t1": 3, "t2": 2, "(other tasks)": 2}


def test_resolved_letters_are_pruned_after_their_own_retention_and_open_ones_never(db, settings):
    settings.CLEANUP_DEAD_LETTER_RETENTION_DAYS = 3
    settings.CLEANUP_RETENTION_DAYS = 14
    now = timezone.now()
    gone, recent, ancient_open = letter(), letter(), letter(age=timedelta(days=100))
    DeadLetter.objects.filter(pk=gone.pk).update(
        resolved_at=now - timedelta(days=4), resolution="discarded"
    )
    DeadLetter.objects.filter(pk=recent.pk).update(
        resolved_at=now - timedelta(days=2), resolution="discarded"
    )
    receipt = CleanupReceipt.objects.create(
        idempotency_key="release:1:1", reservation_id=1, version=1, outcome="released"
    )
    CleanupReceipt.objects.filter(pk=receipt.pk).update(created_at=now - timedelta(days=4))
    result = outbox.prune()
    assert (result["dead_letters"], result["receipts"]) == (1, 0)
    assert sorted(DeadLetter.objects.values_list("pk", flat=True)) == [recent.pk, ancient_open.pk]


# --- discard_dead_letters ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["discard_dead_letters", "requeue_dead_letters"])
def test_every_option_of_the_dead_letter_commands_has_help_with_its_default(name):
    parser = load_command_class("cleanup", name).create_parser("manage.py", name)
    own = [
        a
        for a in parser._actions
        if a.dest in ("reason", "task", "older_than", "ids", "all", "limit", "dry_run", "by", "why")
    ]
    assert len(own) >= 8
    text = parser.format_help()
    for action in own:
        assert action.help, f"{action.option_strings} has no help"
        assert "default" in action.help or "required" in action.help, action.option_strings
    assert "(default: 1000)" in text or "(default: 10000)" in text
    assert "the OS user" in text


def test_discard_dry_run_says_how_many_by_reason_and_changes_nothing(db):
    letters = [letter(MALFORMED), letter(MALFORMED), letter(UNKNOWN, "x"), letter()]
    out, _ = run("discard_dead_letters", "--all", "--dry-run")
    assert "would discard 4 open dead letter(s) (malformed 3, unknown_task 1)" in out
    assert f"first ids: #{letters[0].pk}, #{letters[1].pk}" in out
    assert "nothing changed (--dry-run)" in out
    assert all(is_open(*letters))
    assert not LogEntry.objects.exists()


def test_discard_acts_only_on_letters_matching_every_filter_and_records_who_and_why(db):
    old_a = letter(UNKNOWN, "a", age=timedelta(hours=3))
    new_a = letter(UNKNOWN, "a")
    old_b = letter(UNKNOWN, "b", age=timedelta(hours=3))
    old_malformed = letter(MALFORMED, "a", age=timedelta(hours=3))
    out, _ = run(
        "discard_dead_letters",
        "--reason",
        "unknown_task",
        "--task",
        "a",
        "--older-than",
        "2h",
        "--by",
        "carol",
        "--why",
        "a retired producer's task",
    )
    assert "discarded 1 (unknown_task 1)" in out and "by carol" in out
    assert is_open(old_a, new_a, old_b, old_malformed) == [False, True, True, True]
    old_a.refresh_from_db()
    assert (old_a.resolution, old_a.resolved_by, old_a.resolution_note) == (
        "discarded",
        "carol",
        "a retired producer's task",
    )
    # its history: the inactive manage.py account (there is no Django user carol), naming her
    assert history(old_a.pk) == [
        (
            "manage.py",
            "discard_dead_letters (manage.py, by carol): discarded; why: a retired producer's task",
        )
    ]
    assert not User.objects.get(username="manage.py").is_active
    # --id
    run("discard_dead_letters", "--id", str(old_b.pk), "--why", "seen")
    assert is_open(old_b, old_malformed) == [False, True]


def test_a_discard_by_a_django_users_name_is_in_that_users_history(db):
    User.objects.create_user("dora", is_staff=True)
    x = letter()
    run("discard_dead_letters", "--reason", "malformed", "--by", "dora", "--why", "known bug")
    assert history(x.pk) == [
        ("dora", "discard_dead_letters (manage.py, by dora): discarded; why: known bug")
    ]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--why", "x"], "name what to discard: --reason, --task, --older-than or --id"),
        (["--all"], "--why: say why these letters are discarded"),
        (["--all", "--why", "x" * 501], "--why: the reason is 501 characters long; at most 500"),
        (["--older-than", "soon", "--why", "x"], "--older-than: 'soon' is not an age"),
        (["--all", "--why", "x", "--limit", "0"], "--limit must be at least 1"),
    ],
)
def test_discard_refuses_unclear_input_saying_why_and_exits_1(db, args, words):
    x = letter()
    with pytest.raises(CommandError, match=words) as refused:
        run("discard_dead_letters", *args)
    assert refused.value.returncode == 1
    assert is_open(x) == [True]


def test_discard_stops_at_its_limit_and_says_how_many_more_match(db):
    letters = [letter() for _ in range(5)]
    out, _ = run("discard_dead_letters", "--all", "--limit", "2", "--why", "noise")
    assert "discarded 2 (malformed 2)" in out
    assert "stopped at --limit 2: 3 more open dead letter(s) match" in out
    assert is_open(*letters) == [False, False, True, True, True]


# --- requeue_dead_letters ------------------------------------------------------------------------


def test_requeue_shows_progress_a_summary_and_how_many_more_match(db, broker, settings):
    good = [requeueable(100 + i) for i in range(3)]
    bad = [letter(MALFORMED), letter(MALFORMED)]
    # dry run first: what each would become, nothing sent
    out, _ = run("requeue_dead_letters", "--dry-run", "--limit", "4")
    assert "would requeue 4 open dead letter(s) (retries_exhausted 3, malformed 1)" in out
    assert "would requeue: republished: 3" in out
    assert "stopped at --limit 4: 1 more open dead letter(s) match" in out
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    # then for real
    out, err = run("requeue_dead_letters", "--limit", "4", "--by", "erin")
    progress = [line for line in err.splitlines() if line.startswith("progress: ")]
    assert progress[-1].startswith("progress: 4/4 (")
    assert len(progress) == 4  # one line per letter up to 10, then about 10 in all
    assert "summary: requeued 3 (republished 3, rescheduled 0), failed 0, skipped 1" in out
    assert "stopped at --limit 4: 1 more open dead letter(s) match" in out
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 3
    assert is_open(*good, *bad) == [False, False, False, True, True]
    resolved = DeadLetter.objects.get(pk=good[0].pk)
    assert (resolved.resolution, resolved.resolved_by) == ("republished", "erin")
    assert history(good[0].pk) == [
        ("manage.py", "requeue_dead_letters (manage.py, by erin): republished")
    ]
    assert history(bad[0].pk) == []  # not requeueable: still open, nothing to record


@pytest.mark.django_db(transaction=True)
def test_requeue_exits_1_when_a_publish_fails_and_those_letters_stay_open():
    letters = [requeueable(200), requeueable(201)]
    done = subprocess.run(
        [sys.executable, "manage.py", "requeue_dead_letters"],
        cwd=ROOT,
        env=service_env(CELERY_BROKER_URL="redis://127.0.0.1:1/0"),  # nothing listens on 1
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "summary: requeued 0 (republished 0, rescheduled 0), failed 2, skipped 0" in done.stdout
    assert "2 requeue(s) ended in error; those letters stay open" in done.stderr
    assert is_open(*letters) == [True, True]


# --- the admin ------------------------------------------------------------------------------------


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


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


# --- the health page and /metrics ---------------------------------------------------------------


def test_the_health_pages_open_counts_link_to_the_filtered_list_and_show_the_cap(
    root_client, settings
):
    settings.CLEANUP_DEAD_LETTER_OPEN_CAP = 3
    client = root_client
    letter(MALFORMED), letter(MALFORMED), letter(UNKNOWN, "x")
    html = client.get(reverse("cleanup-health") + "?workers=0").content.decode()
    cell = html.split('data-metric="dead-open-malformed">', 1)[1].split("</td>", 1)[0]
    assert f'<a href="{reverse(DEAD_LETTERS)}?reason=malformed&amp;resolved=no"' in cell
    assert ">2</a>" in cell
    total = html.split('data-metric="dead-open-total">', 1)[1].split("</td>", 1)[0]
    assert "cap reached" in total and ">3</a> of 3" in total


def test_metrics_export_the_open_letters_against_the_cap_and_discarding_clears_them(
    client, db, broker, settings
):
    settings.METRICS_TOKEN = "t"
    settings.CLEANUP_DEAD_LETTER_OPEN_CAP = 7

    def scrape() -> dict[tuple[str, str], float]:
        response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer t")
        assert response.status_code == 200
        return {
            (s.name, s.labels.get("reason", "")): s.value
            for family in text_string_to_metric_families(response.content.decode())
            for s in family.samples
            if s.name.startswith("reservation_cleanup_dead_letters_open")
        }

    letters = [letter(MALFORMED), letter(MALFORMED)]
    before = scrape()
    assert before[("reservation_cleanup_dead_letters_open", "malformed")] == 2
    assert before[("reservation_cleanup_dead_letters_open_cap", "")] == 7
    triage.discard(letters, by="ivan", why="seen")
    assert scrape()[("reservation_cleanup_dead_letters_open", "malformed")] == 0


# --- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("CLEANUP_DEAD_LETTER_OPEN_CAP", "0", "CLEANUP_DEAD_LETTER_OPEN_CAP=0 must be >= 1"),
        ("CLEANUP_DEAD_LETTER_OPEN_CAP", "lots", "CLEANUP_DEAD_LETTER_OPEN_CAP='lots' is not an"),
        ("CLEANUP_DEAD_LETTER_RETENTION_DAYS", "0", "CLEANUP_DEAD_LETTER_RETENTION_DAYS=0 must be"),
        ("CLEANUP_DEAD_LETTER_RETENTION_DAYS", "2w", "CLEANUP_DEAD_LETTER_RETENTION_DAYS='2w' is"),
    ],
)
def test_the_dead_letter_settings_are_checked_at_start_up_naming_the_variable(name, value, words):
    out = run_with("import django; django.setup()", **{name: value})
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]
