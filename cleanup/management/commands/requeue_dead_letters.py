"""``python manage.py requeue_dead_letters``: send open dead letters' messages again (same
idempotency key), or make a set-aside hold due for a sweep again."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.core.management.base import CommandError, CommandParser

from cleanup.management import dead_letter_commands
from cleanup.models import DeadLetter
from cleanup.operations.triage import NOT_TRIED, requeue
from reservations.commands import ProjectCommand

COMMAND = "requeue_dead_letters"
REQUEUED = ("republished", "rescheduled")
PROGRESS_LINES = 10  # about this many progress lines per run


class Command(ProjectCommand):
    help = (
        "Requeue open dead letters: republish each release message (same idempotency key, so "
        "a message already handled ends already_handled) or make a set-aside hold due again. "
        "Prints progress and a summary; exits 1 when a requeue ended in error (it stops there: "
        "that letter and the ones after it stay open). Use --dry-run first to see what it "
        "would do."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        dead_letter_commands.add_filter_arguments(parser)
        dead_letter_commands.add_batch_arguments(
            parser,
            verb="requeue",
            limit=1000,
            shows="how many, by reason, what each would become, the first ids",
        )
        dead_letter_commands.add_operator_arguments(parser, why_required=False)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["limit"] < 1:
            raise CommandError("--limit must be at least 1")
        batch = dead_letter_commands.take_batch(
            dead_letter_commands.letter_filter(options), options["limit"]
        )
        letters, reasons = batch.letters, batch.reasons
        if not letters:
            self.stdout.write("no open dead letters matched")
            return
        if options["dry_run"]:
            plan = requeue(letters, dry_run=True)
            self.stdout.write(f"would requeue {len(letters)} open dead letter(s) ({reasons})")
            for action, count in sorted(plan.items()):
                self.stdout.write(f"would requeue: {action}: {count}")
            self.stdout.write(f"first ids: {dead_letter_commands.first_ids(letters)}")
            batch.write_more(self.stdout)
            self.stdout.write("nothing changed (--dry-run)")
            return
        self.stdout.write(f"requeueing {len(letters)} open dead letter(s) ({reasons})")
        done: dict[str, list[DeadLetter]] = {}
        step = max(1, -(-len(letters) // PROGRESS_LINES))

        def each(letter: DeadLetter, result: str) -> None:
            done.setdefault(result, []).append(letter)
            seen = sum(len(v) for v in done.values())
            if seen % step == 0 or seen == len(letters):
                counts = ", ".join(f"{k} {len(v)}" for k, v in sorted(done.items()))
                self.stderr.write(f"progress: {seen}/{len(letters)} ({counts})")

        why = (options["why"] or "").strip()
        errors: list[str] = []

        def error(letter: DeadLetter, exc: Exception) -> None:
            errors.append(f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")

        results = requeue(letters, on_each=each, by=options["by"], why=why, on_error=error)
        dead_letter_commands.log_history(
            COMMAND, options["by"], {k: v for k, v in done.items() if k in REQUEUED}, why
        )
        for action, count in sorted(results.items()):
            self.stdout.write(f"requeued: {action}: {count}")
        self.stdout.write(self._summary(results))
        batch.write_more(self.stdout)
        if results["error"]:
            untried = results[NOT_TRIED]
            raise CommandError(
                f"a requeue ended in error, so the {untried} letter(s) after it were not tried; "
                f"those letters stay open. Error: {errors[0] if errors else 'see the log'}. "
                f"Run it again once the broker or database is back"
            )

    @staticmethod
    def _summary(results: Counter[str]) -> str:
        requeued = sum(results[k] for k in REQUEUED)
        skipped = {k: n for k, n in results.items() if k not in (*REQUEUED, "error", NOT_TRIED)}
        detail = ", ".join(f"{k} {n}" for k, n in sorted(skipped.items()))
        return (
            f"summary: requeued {requeued} (republished {results['republished']}, rescheduled "
            f"{results['rescheduled']}), failed {results['error']}, not tried "
            f"{results[NOT_TRIED]}, skipped {sum(skipped.values())}"
            + (f" ({detail})" if detail else "")
        )
