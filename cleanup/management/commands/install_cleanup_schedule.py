from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from cleanup.schedule import install_schedule


class Command(BaseCommand):
    help = "Install or update the per-shard sweep entries (idempotent) plus relay and prune."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--shards", type=int, default=4, help="number of shards N")
        parser.add_argument("--every", type=int, default=10, help="sweep interval in seconds")
        parser.add_argument("--relay-every", type=int, default=5, help="outbox relay interval")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = install_schedule(
                options["shards"], options["every"], relay_every=options["relay_every"]
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(
            f"schedule: {result['shards']} shard(s) every {options['every']}s; "
            f"{result['changed']} entr(y/ies) created or changed, {result['removed']} removed"
        )
