"""``python manage.py worker_health [--name worker@host] [--timeout 5]``: exit 0 when the named
worker answers a ping (``celery inspect ping -d <name>``), 1 otherwise. For docker-compose:

    healthcheck: {test: ["CMD", "python", "manage.py", "worker_health"]}

The name defaults to ``worker@<this host's name>`` (compose's ``-n worker@%h``).
"""

from __future__ import annotations

import socket
from typing import Any

from django.core.management.base import CommandParser

from cleanup.broker.celery_app import app
from reservations.commands import ProjectCommand


class Command(ProjectCommand):
    help = "Ping the local Celery worker; exit 1 when it does not answer."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--name",
            default=f"worker@{socket.gethostname()}",
            help="the worker's node name (default: worker@<this host's name>)",
        )
        parser.add_argument(
            "--timeout", type=float, default=5.0, help="seconds to wait for the answer"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        try:
            replies = app.control.ping(destination=[name], timeout=options["timeout"])
        except Exception as exc:  # noqa: BLE001 - the broker being down is "unhealthy"
            self.stderr.write(f"unhealthy: cannot reach the broker: {exc!r}")
            raise SystemExit(1) from None
        if any(name in reply for reply in replies or []):
            self.stdout.write(f"ok: {name} answered")
            return
        self.stderr.write(f"unhealthy: {name} did not answer within {options['timeout']} s")
        raise SystemExit(1)
