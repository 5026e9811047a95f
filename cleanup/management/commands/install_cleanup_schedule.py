from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from cleanup.operations.schedule_preview import preview
from cleanup.release.schedule import ensure_schedule, install_schedule
from reservations.commands import ProjectCommand


class Command(ProjectCommand):
    help = (
        "Create the Cleanup schedule (per-shard sweep entries plus relay, prune and sample) "
        "only when none exists; an existing schedule, possibly edited in the admin, is kept "
        "and re-applied. --force resets it to the given values."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--shards", type=int, default=4, help="number of shards N (one sweep entry each)"
        )
        parser.add_argument("--every", type=int, default=10, help="sweep interval in seconds")
        parser.add_argument(
            "--relay-every", type=int, default=5, help="outbox relay interval in seconds"
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="overwrite an existing schedule (and the relay/prune/sample entries)",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="print the entries it would add, remove and change, and the sweeps per second "
            "before and after; write nothing",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["dry_run"]:
            self._dry_run(options)
            return
        try:
            if options["force"]:
                result = install_schedule(
                    options["shards"], options["every"], relay_every=options["relay_every"]
                )
                verb = "reset to"
                every: int = options["every"]
                enabled: bool = True
            else:
                result = ensure_schedule(
                    options["shards"], options["every"], relay_every=options["relay_every"]
                )
                verb = "created:" if result["created"] else "kept (exists; --force resets it):"
                every, enabled = int(result["every"]), bool(result["enabled"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        state = "enabled" if enabled else "DISABLED"
        self.stdout.write(
            f"schedule {verb} {result['shards']} shard(s) every {every}s, {state}; "
            f"{result['changed']} entr(y/ies) created or changed, {result['removed']} removed"
        )

    def _dry_run(self, options: dict[str, Any]) -> None:
        install = install_schedule if options["force"] else ensure_schedule
        try:
            planned = preview(
                lambda: install(
                    options["shards"], options["every"], relay_every=options["relay_every"]
                )
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write("dry run: nothing is written")
        for line in planned.lines():
            self.stdout.write(line)
