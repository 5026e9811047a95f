"""``python manage.py discard_dead_letters``: resolve open dead letters without sending
anything, recording who and why (the admin's "Discard" action, from a shell)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from cleanup.management import dead_letter_commands
from cleanup.operations.triage import by_reason, clean_why, discard
from cleanup.release.dead_letters import DISCARDED
from reservations.commands import ProjectCommand

COMMAND = "discard_dead_letters"


class Command(ProjectCommand):
    help = (
        "Discard open dead letters matching a filter: each is resolved (resolution discarded) "
        "with the operator and why, and gets an admin history entry; nothing is sent. Name "
        "what to discard (--reason, --task, --older-than, --id, or --all); --dry-run shows "
        "what it would do."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        dead_letter_commands.add_filter_arguments(parser)
        parser.add_argument(
            "--all",
            action="store_true",
            help="every open letter, when no filter is given (default: off; without a filter "
            "or --all the command refuses)",
        )
        dead_letter_commands.add_batch_arguments(
            parser, verb="discard", limit=10_000, shows="how many, by reason, the first ids"
        )
        dead_letter_commands.add_operator_arguments(parser, why_required=True)

    def handle(self, *args: Any, **options: Any) -> None:
        selection = dead_letter_commands.letter_filter(options)
        if selection.empty and not options["all"]:
            raise CommandError(
                "name what to discard: --reason, --task, --older-than or --id (or --all for "
                "every open letter)"
            )
        if options["limit"] < 1:
            raise CommandError("--limit must be at least 1")
        why = ""
        if not options["dry_run"]:
            try:
                why = clean_why(options["why"])
            except ValueError as exc:
                raise CommandError(f"--why: {exc}") from None
        batch = dead_letter_commands.take_batch(selection, options["limit"])
        letters = batch.letters
        if not letters:
            self.stdout.write("no open dead letters matched")
            return
        if options["dry_run"]:
            self.stdout.write(f"would discard {len(letters)} open dead letter(s) ({batch.reasons})")
            self.stdout.write(f"first ids: {dead_letter_commands.first_ids(letters)}")
            batch.write_more(self.stdout)
            self.stdout.write("nothing changed (--dry-run)")
            return
        done = discard(letters, by=options["by"], why=why)
        discarded = done.get(DISCARDED, [])
        dead_letter_commands.log_history(COMMAND, options["by"], {DISCARDED: discarded}, why)
        skipped = len(done.get("already_resolved", []))
        self.stdout.write(
            f"discarded {len(discarded)} ({', '.join(f'{r} {n}' for r, n in by_reason(discarded))})"
            f", already resolved (left as they are) {skipped}; by {options['by']}; why: {why}"
        )
        batch.write_more(self.stdout)
