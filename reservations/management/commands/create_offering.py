"""``python manage.py create_offering --name NAME --capacity N``: an offering learners can hold
seats in, through ``reservations.services.create_offering`` (all its seats free). Prints the
new offering; ``--id-only`` prints just its id, for scripts (the README's try-it story).
The admin's Offerings → Add does the same."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from reservations import services
from reservations.commands import ProjectCommand
from reservations.models import Offering

NAME_MAX_LENGTH = Offering._meta.get_field("name").max_length or 200
MAX_CAPACITY = 2**31 - 1  # the column is a PostgreSQL integer


class Command(ProjectCommand):
    help = "Create an offering with CAPACITY seats, all free; print it (or only its id)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True, help="the offering's name (required)")
        parser.add_argument(
            "--capacity", type=int, required=True, help="number of seats, >= 0 (required)"
        )
        parser.add_argument(
            "--id-only", action="store_true", help="print only the new offering's id"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"].strip()
        capacity = options["capacity"]
        if not name:
            raise CommandError("--name must not be blank")
        if len(name) > NAME_MAX_LENGTH:
            raise CommandError(f"--name must be at most {NAME_MAX_LENGTH} characters")
        if "\x00" in name:
            raise CommandError("--name must not contain NUL")
        if not 0 <= capacity <= MAX_CAPACITY:
            raise CommandError(f"--capacity must be between 0 and {MAX_CAPACITY}")
        offering = services.create_offering(name, capacity)
        if options["id_only"]:
            self.stdout.write(str(offering.pk))
            return
        self.stdout.write(
            f"created offering {offering.pk} {offering.name!r}: {capacity} seat(s), all free"
        )
