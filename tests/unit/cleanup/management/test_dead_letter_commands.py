"""What the dead-letter commands share (cleanup.management.dead_letter_commands): every filter
option has help with its default."""

from __future__ import annotations

import pytest
from django.core.management import load_command_class


@pytest.mark.parametrize("name", ["discard_dead_letters", "requeue_dead_letters"])
def test_every_option_of_the_dead_letter_commands_has_help_with_its_default(name):
    parser = load_command_class("cleanup", name).create_parser("manage.py", name)
    own = [
        a
        for a in parser._actions
        if a.dest in ("reason", "task", "older_than", "ids", "all", "limit", "dry_run", "by", "why")
    ]
    assert len(own) >= 8
    text = parser.format_help()
    for action in own:
        assert action.help, f"{action.option_strings} has no help"
        assert "default" in action.help or "required" in action.help, action.option_strings
    assert "(default: 1000)" in text or "(default: 10000)" in text
    assert "the OS user" in text
