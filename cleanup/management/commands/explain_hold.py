"""``python manage.py explain_hold <id>``: why is this hold (still) held?"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from cleanup.operations.console.story import explain
from reservations.commands import ProjectCommand


class Command(ProjectCommand):
    help = "Tell a hold's story (versions, claims, deliveries, receipts, dead letters) + verdict."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "reservation_id", type=int, help="the hold's id (the API's \"id\"); exit 1 if none"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        story = explain(options["reservation_id"])
        self.stdout.write(story.text())
        if not story.found:
            raise SystemExit(1)
