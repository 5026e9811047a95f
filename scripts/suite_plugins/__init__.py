"""pytest plugins that run the libraries' own published tests against our subclasses of their
internals (``scripts/library_suites.py`` loads them; docs/TESTING.md, "The libraries' own
suites")."""

from __future__ import annotations

from typing import Any

import pytest


def select(
    items: list[pytest.Item],
    config: pytest.Config,
    deselect: dict[str, str],
    suite: str,
) -> None:
    """Drop the ``deselect`` node ids from the run, saying why; a node id the suite no longer has
    is an error (the list was written for another version of the suite)."""
    collected = {item.nodeid for item in items}
    stale = sorted(set(deselect) - collected)
    if stale:
        raise pytest.UsageError(
            f"{suite}: deselected tests not in this suite (written for another version?): "
            + ", ".join(stale)
        )
    dropped = [item for item in items if item.nodeid in deselect]
    items[:] = [item for item in items if item.nodeid not in deselect]
    config.hook.pytest_deselected(items=dropped)


def report(terminalreporter: Any, title: str, lines: dict[str, str]) -> None:
    if lines:
        terminalreporter.section(title)
        for nodeid, reason in lines.items():
            terminalreporter.write_line(f"{nodeid}\n    {reason}")
