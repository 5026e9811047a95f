"""What the project's management commands share: ``--help`` shows each option's default.

Every command under ``*/management/commands/`` subclasses :class:`ProjectCommand`. Its parser
keeps Django's layout (the command's own options first, Django's common ones last) and appends
``(default: X)`` to an option whose default is a value. A flag (off unless given) and an option
without a default get nothing appended: their help says what happens when they are not given.
``tests/unit/reservations/test_commands.py`` walks every command's parser and fails on an
option without help. A command with many options writes them as a table, one line an option,
for ``add_options``.

A command that changes what the admin also changes records who ran it (``--by``, by default the
OS user) in the admin's history: ``history_user_id`` names the Django user of that name, else
the inactive account ``manage.py`` (created on first use, no password).
"""

from __future__ import annotations

import argparse
import getpass
from collections.abc import Iterable
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser, DjangoHelpFormatter

CLI_USERNAME = "manage.py"


class HelpFormatter(DjangoHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or text == argparse.SUPPRESS or "%(default)" in text:
            return text
        default = action.default
        if default is None or default is argparse.SUPPRESS or isinstance(default, bool):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


class ProjectCommand(BaseCommand):
    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        kwargs.setdefault("formatter_class", HelpFormatter)
        return super().create_parser(prog_name, subcommand, **kwargs)


# One option of a command's table: its flag, its type (``bool``: a flag, off unless given), its
# default and its help.
Option = tuple[str, type, object, str]


def add_options(parser: CommandParser, options: Iterable[Option]) -> None:
    for flag, kind, default, text in options:
        if kind is bool:
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=text)


def os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no USER/LOGNAME and no passwd entry (some containers)
        return "unknown"


def history_user_id(by: str) -> int:
    """The Django user named ``by``, else the inactive ``manage.py`` account: an admin history
    entry needs a user."""
    user_model = get_user_model()
    manager = user_model._default_manager
    field = user_model.USERNAME_FIELD
    found = manager.filter(**{field: by}).values_list("pk", flat=True).first()
    if found is not None:
        return int(found)
    user, created = manager.get_or_create(**{field: CLI_USERNAME}, defaults={"is_active": False})
    if created:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    return int(user.pk)
