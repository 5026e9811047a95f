"""The project's management commands as a user meets them on the command line: every option has
help, ``--help`` shows each default, and each error path exits non-zero (1: refused by the
command; 2: arguments argparse cannot parse) with a message. Commands run through
``run_from_argv``, the path ``manage.py`` takes, in this process."""

from __future__ import annotations

import argparse
import re

import pytest
from django.core.management import load_command_class
from django.core.management.base import BaseCommand

from reservations.commands import HelpFormatter
from tests.support.commands import project_commands, run_from_argv

# Options every Django command has (their help is Django's).
DJANGO_OPTIONS = {
    action.dest for action in BaseCommand().create_parser("manage.py", "x")._actions
} | {"help"}


def _parser(name: str) -> argparse.ArgumentParser:
    command = load_command_class(project_commands()[name], name)
    return command.create_parser("manage.py", name)


def _parsers(name: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """The command's parser, then each of its actions' (``api_clients create``) when it has
    subcommands: their options are not on the command's own parser."""
    parser = _parser(name)
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(f"{name} {sub}", p) for sub, p in action.choices.items()]
    return found


def _own_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest not in DJANGO_OPTIONS]


def _name(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or action.dest


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


COMMANDS = project_commands()


def test_the_walk_finds_every_project_command() -> None:
    assert {
        "api_clients",
        "beat_health",
        "burst",
        "capacity_plan",
        "create_offering",
        "discard_dead_letters",
        "explain_hold",
        "install_cleanup_schedule",
        "requeue_dead_letters",
        "worker_health",
    } <= set(project_commands())


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help_and_its_default_is_shown(name: str) -> None:
    for label, parser in _parsers(name):
        _check_help(label, parser)


def _check_help(name: str, parser: argparse.ArgumentParser) -> None:
    formatter = parser._get_formatter()
    assert isinstance(formatter, HelpFormatter), f"{name}: not a ProjectCommand"
    without_help = [
        _name(a)
        for a in _own_actions(parser)
        if not (a.help or "").strip() or a.help == "==SUPPRESS=="
    ]
    assert without_help == [], f"{name}: options without help: {without_help}"
    # argparse wraps lines, also after a hyphen: compare without any white space
    shown = re.sub(r"\s+", "", parser.format_help())
    for action in _own_actions(parser):
        expanded = _flat(formatter._expand_help(action))
        assert re.sub(r"\s+", "", expanded) in shown, f"{name} {_name(action)}: not in --help"
        default = action.default
        if isinstance(default, bool) or action.required or not action.option_strings:
            continue  # a flag is off unless given; a required value has no default
        if default is None:  # nothing to show: the help says what happens without it
            assert "default" in expanded, f"{name} {_name(action)}: say what its absence means"
        else:
            assert f"(default: {default})" in expanded, f"{name} {_name(action)}: no default"


def test_help_shows_the_defaults_as_a_user_reads_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        load_command_class("tools", "burst").run_from_argv(["manage.py", "burst", "--help"])
    assert exit_.value.code == 0
    shown = _flat(capsys.readouterr().out)
    assert "--holds HOLDS holds to create (default: 12000)" in shown
    assert (
        "--window WINDOW seconds over which the holds expire; 0 = all at once (default: 300.0)"
        in shown
    )
    assert (
        "--timeout TIMEOUT give up after this many seconds (default: lead + window + 600)" in shown
    )
    assert "--no-sweeps do not send sweeps (a beat is running) --" in shown  # no "(default: False)"


ERRORS_BEFORE_ANY_DATABASE_WORK: list[tuple[str, list[str], int, str]] = [
    ("create_offering", ["--capacity", "2"], 2, "the following arguments are required: --name"),
    ("create_offering", ["--name", "A", "--capacity", "two"], 2, "invalid int value: 'two'"),
    ("create_offering", ["--name", "A", "--capacity", "-1"], 1, "--capacity must be between 0"),
    ("create_offering", ["--name", "  ", "--capacity", "2"], 1, "--name must not be blank"),
    ("create_offering", ["--name", "x" * 201, "--capacity", "2"], 1, "at most 200 characters"),
    ("burst", ["--holds", "0"], 1, "--holds must be >= 1"),
    ("burst", ["--renew-fraction", "1.5"], 1, "--renew-fraction must be in [0, 1]"),
    ("burst", ["--kill-at", "5"], 1, "--drain-at/--kill-at need --workers"),
    ("capacity_plan", [], 1, "give an arrival rate, or holds and a window > 0 s"),
    ("capacity_plan", ["--arrival-rate", "10"], 1, "give a service time or a per-worker rate"),
    ("capacity_plan", ["--from-report", "/nonexistent/report.json"], 1, "report.json"),
    ("install_cleanup_schedule", ["--shards", "0"], 1, "shards must be between 1 and 1024"),
    ("install_cleanup_schedule", ["--every", "0"], 1, "every must be at least 1 second"),
    ("explain_hold", ["first"], 2, "invalid int value: 'first'"),
    ("worker_health", ["--timeout", "soon"], 2, "invalid float value: 'soon'"),
    ("api_clients", [], 2, "the following arguments are required: ACTION"),
    ("api_clients", ["create", "a"], 2, "one of the arguments --all-offerings --offering is"),
    ("api_clients", ["create", " ", "--all-offerings"], 1, "NAME must not be blank"),
    ("api_clients", ["create", "a", "--all-offerings", "--scopes", "all"], 1, "unknown scope"),
    ("api_clients", ["revoke", "a"], 2, "one of the arguments --token --all is required"),
]


@pytest.mark.parametrize(
    ("name", "args", "code", "message"),
    ERRORS_BEFORE_ANY_DATABASE_WORK,
    ids=[f"{n}:{' '.join(a)[:30]}" for n, a, _, _ in ERRORS_BEFORE_ANY_DATABASE_WORK],
)
def test_an_error_exits_non_zero_and_says_why(
    name: str, args: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_from_argv(name, *args) == code
    captured = capsys.readouterr()
    assert message in _flat(captured.err)
    assert captured.out == ""
