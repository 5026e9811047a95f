"""What the dead-letter commands (``requeue_dead_letters``, ``discard_dead_letters``) share:
the filter options, the operator they record, and the admin history rows they write.

A command's operator is ``--by`` or the OS user. Each letter it resolves keeps that name
(``resolved_by``) and gets an admin history entry; the entry's user is the Django user of
that name when there is one, else the inactive account ``manage.py`` (created on first use,
no password), and its message names the command and the operator either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.core.management.base import CommandError, CommandParser

from cleanup.models import DeadLetter
from cleanup.operations import triage
from reservations import admin_guard
from reservations.commands import history_user_id, os_user

SHOWN_IDS = 20


def add_filter_arguments(parser: CommandParser) -> None:
    parser.add_argument(
        "--reason",
        choices=[c for c, _ in DeadLetter.Reason.choices],
        help="only letters with this reason (default: any reason)",
    )
    parser.add_argument(
        "--task",
        metavar="NAME",
        help="only letters of this task name, exactly (default: any task)",
    )
    parser.add_argument(
        "--older-than",
        metavar="AGE",
        help="only letters written more than AGE ago: a number and s, m, h, d or w, "
        "e.g. 30m, 6h, 7d (default: any age)",
    )
    parser.add_argument(
        "--id",
        type=int,
        action="append",
        dest="ids",
        metavar="ID",
        help="only this dead letter; repeat for several (default: any id)",
    )


def add_batch_arguments(parser: CommandParser, *, verb: str, limit: int, shows: str) -> None:
    """``--limit`` and ``--dry-run``, as both dead-letter commands take them."""
    parser.add_argument(
        "--limit",
        type=int,
        default=limit,
        metavar="N",
        help=f"{verb} at most N letters, lowest ids first; says how many more match "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"show what would be done ({shows}) and change nothing (default: off)",
    )


def add_operator_arguments(parser: CommandParser, *, why_required: bool) -> None:
    parser.add_argument(
        "--by",
        default=os_user(),
        metavar="NAME",
        help="the operator recorded on each letter and in its history; by default the OS user",
    )
    parser.add_argument(
        "--why",
        default=None,
        metavar="TEXT",
        help=(
            "why, kept on each letter and in its history; required unless --dry-run (no default)"
            if why_required
            else "why, kept on each letter and in its history (default: none)"
        ),
    )


def letter_filter(options: dict[str, Any]) -> triage.LetterFilter:
    older_than = None
    if options.get("older_than"):
        try:
            older_than = triage.parse_age(options["older_than"])
        except ValueError as exc:
            raise CommandError(f"--older-than: {exc}") from None
    return triage.LetterFilter(
        reason=options.get("reason") or "",
        task=options.get("task") or "",
        older_than=older_than,
        ids=tuple(options.get("ids") or ()),
    )


@dataclass(frozen=True)
class Batch:
    """The open letters one run of a command acts on: the first ``limit`` that match, by id,
    and how many more match beyond them (0 when the limit was not reached)."""

    letters: list[DeadLetter]
    limit: int
    more: int

    @property
    def reasons(self) -> str:
        """``"<reason> <count>, ..."``, the most frequent first."""
        return ", ".join(f"{r} {n}" for r, n in triage.by_reason(self.letters))

    def write_more(self, out: Any) -> None:
        """Say, when the limit cut the selection, that more letters match."""
        if self.more:
            out.write(
                f"stopped at --limit {self.limit}: {self.more} more open dead letter(s) match; "
                f"run it again for the rest"
            )


def take_batch(selection: triage.LetterFilter, limit: int) -> Batch:
    matching = selection.open_letters()
    letters = list(matching[:limit])
    more = matching.count() - len(letters) if len(letters) == limit else 0
    return Batch(letters, limit, more)


def first_ids(letters: Iterable[DeadLetter]) -> str:
    ids = [int(letter.pk) for letter in letters]
    shown = ", ".join(f"#{pk}" for pk in ids[:SHOWN_IDS])
    return shown + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


def log_history(
    command: str, by: str, letters_by_result: dict[str, list[DeadLetter]], why: str = ""
) -> None:
    """One admin history entry per letter: ``<command> (manage.py, by <by>): <result>``."""
    suffix = f"; why: {why}" if why else ""
    admin_guard.log_rows(
        history_user_id(by),
        {f"{result}{suffix}": letters for result, letters in letters_by_result.items()},
        f"{command} (manage.py, by {by})",
    )
