"""The project's management commands, run as ``manage.py`` runs them, in this process."""

from __future__ import annotations

from django.core.management import get_commands, load_command_class

PROJECT_APPS = ("cleanup", "reservations", "tools")


def project_commands() -> dict[str, str]:
    """Every command of the project's apps: its name and its app."""
    return {name: app for name, app in sorted(get_commands().items()) if app in PROJECT_APPS}


def run_from_argv(name: str, *args: str) -> int:
    """``manage.py name args`` through ``run_from_argv`` (argument parsing included): its exit
    status."""
    command = load_command_class(project_commands()[name], name)
    try:
        command.run_from_argv(["manage.py", name, *args])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
