"""A test skipped for a missing tool fails in CI and is named at the end of a person's run
(tests/support/missing_tools.py), checked by running pytest on a small test file in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

NEEDS_A_TOOL = """
from tests.support.missing_tools import leave_out, skip_for_missing
import pytest

def test_needs_frobnicate():
    skip_for_missing("frobnicate", "not on PATH")

@pytest.fixture
def frob():
    skip_for_missing("frobnicate", "not on PATH (fixture)")

def test_needs_frobnicate_through_a_fixture(frob):
    pass

def test_skipped_for_another_reason():
    pytest.skip("Redis only")

def test_this_queue_type_cannot_show():
    leave_out("quorum queues", "a quorum queue cannot be made to refuse it")

def test_runs():
    assert True
"""


def _pytest(tmp_path: Path, ci: str | None) -> tuple[subprocess.CompletedProcess[str], str]:
    (tmp_path / "test_tools.py").write_text(NEEDS_A_TOOL)
    report_file = tmp_path / "missing.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(ROOT)
    env["RESERVATIONS_MISSING_TOOLS_FILE"] = str(report_file)
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.missing_tools", "-p", "no:django",
         "-p", "no:cacheprovider", "-p", "no:randomly", "-rA", "test_tools.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return done, report_file.read_text() if report_file.exists() else ""


def test_in_ci_a_skip_for_a_missing_tool_fails_the_run(tmp_path: Path) -> None:
    done, _ = _pytest(tmp_path, ci="true")
    assert done.returncode == 1, done.stdout
    # the test body's skip is a failure, the fixture's an error; other skips stay skips
    assert "1 failed, 1 passed, 2 skipped, 1 error" in done.stdout, done.stdout
    assert "FAILED test_tools.py::test_needs_frobnicate " in done.stdout
    assert "ERROR test_tools.py::test_needs_frobnicate_through_a_fixture" in done.stdout
    assert "CI is set, so a missing tool fails the test" in done.stdout
    assert "SKIPPED [1] test_tools.py:" in done.stdout and "Redis only" in done.stdout
    # what this run's queue type cannot show is left out in CI too, and said so at the end
    assert "not shown with quorum queues: 1 test(s): test_tools.py::test_this_queue_type" in (
        done.stdout
    )


def test_in_a_persons_run_it_skips_and_the_run_says_what_was_left_out(tmp_path: Path) -> None:
    done, listed = _pytest(tmp_path, ci=None)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 4 skipped" in done.stdout, done.stdout
    lines = [
        "skipped because frobnicate is missing: 2 test(s): "
        "test_tools.py::test_needs_frobnicate, "
        "test_tools.py::test_needs_frobnicate_through_a_fixture",
        "not shown with quorum queues: 1 test(s): test_tools.py::test_this_queue_type_cannot_show",
    ]
    assert all(line in done.stdout for line in lines)
    assert listed == "".join(line + "\n" for line in lines)  # "Redis only" is not listed
