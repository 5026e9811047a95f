from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from cleanup.deadletters import requeue
from cleanup.models import DeadLetter


class Command(BaseCommand):
    help = "Requeue open dead letters (same idempotency key, so requeueing is safe)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--reason", choices=[c for c, _ in DeadLetter.Reason.choices])
        parser.add_argument("--id", type=int, action="append", dest="ids", help="dead letter id")
        parser.add_argument("--limit", type=int, default=1000)
        parser.add_argument("--dry-run", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        letters = DeadLetter.objects.filter(resolved_at__isnull=True).order_by("id")
        if options["reason"]:
            letters = letters.filter(reason=options["reason"])
        if options["ids"]:
            letters = letters.filter(pk__in=options["ids"])
        results = requeue(list(letters[: options["limit"]]), dry_run=options["dry_run"])
        prefix = "would requeue" if options["dry_run"] else "requeued"
        if not results:
            self.stdout.write("no open dead letters matched")
        for action, count in sorted(results.items()):
            self.stdout.write(f"{prefix}: {action}: {count}")
