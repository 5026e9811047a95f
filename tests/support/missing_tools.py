"""One way for a test to say "a tool this test needs is missing here", and what that means.

A test that cannot run because a program or package of the machine is missing (chromium,
prometheus, iptables, root for a network namespace, curl, docker-compose, …) calls
``skip_for_missing(tool, why)``. In a person's run that is a skip, and the hooks below (imported
by ``tests/conftest.py``) list every such skip at the end of pytest's output and in the file
named by ``RESERVATIONS_MISSING_TOOLS_FILE``, which the nox run (noxfile.py) prints at its
end, so a partial run is never mistaken for a full one. With ``CI`` set the same skip is a
failure: CI installs what the suite needs, and a tool it failed to install must fail the run,
not shrink it.

A test that cannot show its behaviour on this run's broker or queue type (a refusal only a
classic queue can be made to give, say) calls ``leave_out(what, why)``: a skip in every run, CI
included, listed at the end beside the missing tools, so the run says what it did not prove.

Skips for any other reason (a Redis-only test module on RabbitMQ, the chaos drills outside CI)
are plain ``pytest.skip`` calls and are not affected.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import NoReturn

import pytest

PREFIX = "missing tool: "
LEFT_OUT_PREFIX = "left out here: "


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_for_missing(tool: str, why: str) -> NoReturn:
    """Skip the running test because ``tool`` is not available here (fails it in CI)."""
    pytest.skip(f"{PREFIX}{tool}: {why}")


def leave_out(what: str, why: str) -> NoReturn:
    """Skip the running test because ``what`` (this run's broker, queue type, …) cannot show
    its behaviour; listed at the end of the run, never a failure."""
    pytest.skip(f"{LEFT_OUT_PREFIX}{what}: {why}")


def left_out_because(reason: str) -> str | None:
    """The ``what`` of a skip reason written by ``leave_out``, else None."""
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(LEFT_OUT_PREFIX):
        return None
    return reason[len(LEFT_OUT_PREFIX) :].partition(": ")[0]


def missing_tool_of(reason: str) -> str | None:
    """The tool named by a skip reason written by ``skip_for_missing``, else None."""
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(PREFIX):
        return None
    return reason[len(PREFIX) :].partition(": ")[0]


# Tests skipped in this run because a tool is missing: {tool: [node ids]}, and those left out
# for what this run cannot show: {what: [node ids]}. Filled from the reports the controlling
# process receives, so they are complete under pytest-xdist too.
_missing: dict[str, list[str]] = {}
_left_out: dict[str, list[str]] = {}


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """In CI a skip for a missing tool is a failure (of the phase that skipped: setup or call)."""
    report = yield
    if report.skipped and in_ci():
        reason = _skip_reason(report)
        if missing_tool_of(reason) is not None:
            report.outcome = "failed"
            report.longrepr = (
                "CI is set, so a missing tool fails the test instead of skipping it: "
                + reason.removeprefix("Skipped: ")
            )
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        reason = _skip_reason(report)
        tool = missing_tool_of(reason)
        if tool is not None:
            _missing.setdefault(tool, []).append(report.nodeid)
        what = left_out_because(reason)
        if what is not None:
            _left_out.setdefault(what, []).append(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name every test this run left out (a missing tool, a broker or queue type that cannot
    show it), at the end of pytest's output and in the file named by
    RESERVATIONS_MISSING_TOOLS_FILE (appended: one file per nox run)."""
    lines = [
        f"skipped because {tool} is missing: {len(ids)} test(s): {', '.join(sorted(ids))}"
        for tool, ids in sorted(_missing.items())
    ] + [
        f"not shown with {what}: {len(ids)} test(s): {', '.join(sorted(ids))}"
        for what, ids in sorted(_left_out.items())
    ]
    if not lines:
        return
    terminalreporter.section("left out: tests this run could not run (a partial run)")
    for line in lines:
        terminalreporter.line(line)
    report_file = os.environ.get("RESERVATIONS_MISSING_TOOLS_FILE")
    if report_file:
        with open(report_file, "a", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines)
