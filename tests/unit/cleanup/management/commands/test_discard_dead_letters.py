"""``manage.py discard_dead_letters``: a dry run changes nothing, the filters combine, who and
why are recorded (in the admin history of a Django user of that name too), unclear input is
refused with exit status 1, and ``--limit`` says how many more match."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.core.management.base import CommandError

from tests.support.dead_letters import MALFORMED, UNKNOWN, history, is_open, letter, run_command


def test_discard_dry_run_says_how_many_by_reason_and_changes_nothing(db):
    letters = [letter(MALFORMED), letter(MALFORMED), letter(UNKNOWN, "x"), letter()]
    out, _ = run_command("discard_dead_letters", "--all", "--dry-run")
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
    out, _ = run_command(
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
    run_command("discard_dead_letters", "--id", str(old_b.pk), "--why", "seen")
    assert is_open(old_b, old_malformed) == [False, True]


def test_a_discard_by_a_django_users_name_is_in_that_users_history(db):
    User.objects.create_user("dora", is_staff=True)
    x = letter()
    run_command(
        "discard_dead_letters", "--reason", "malformed", "--by", "dora", "--why", "known bug"
    )
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
        run_command("discard_dead_letters", *args)
    assert refused.value.returncode == 1
    assert is_open(x) == [True]


def test_discard_stops_at_its_limit_and_says_how_many_more_match(db):
    letters = [letter() for _ in range(5)]
    out, _ = run_command("discard_dead_letters", "--all", "--limit", "2", "--why", "noise")
    assert "discarded 2 (malformed 2)" in out
    assert "stopped at --limit 2: 3 more open dead letter(s) match" in out
    assert is_open(*letters) == [False, False, True, True, True]
