"""The README's try-it story, run as written against a real running system.

``scripts/run.py`` (what ``bash scripts/run.sh`` runs once the venv exists) starts web, worker,
beat and Flower on the tests' database and broker, with the local settings run.sh uses and ports
of its own. The lines between the README's try-it markers (``scripts/tryit.py``) then run, in
order, in one bash, exactly as written; each line must succeed and print what its ``# →``
comment says. Then the database, read here, agrees: both holds released by a cleanup message
once each, the third learner never got a hold, the seats are back. run.py printed the same lines.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

import pytest

from config.settings.test import TEST_DEFAULTS
from tests.support.fleet import ROOT, free_port, scalar, service_env, sql, wait_until
from tests.support.missing_tools import skip_for_missing

sys.path.insert(0, str(ROOT / "scripts"))
import tryit

pytestmark = [pytest.mark.workers, pytest.mark.slow]

MARK = "@@try-it"


def _user_env(port: int, flower_port: int) -> dict[str, str]:
    """A user's environment: no test settings or test defaults, only the tests' database and
    broker (as if configured) and the run's ports."""
    env = service_env()
    for name in [*TEST_DEFAULTS, "DJANGO_SETTINGS_MODULE", "FLOWER_BASIC_AUTH"]:
        if name not in ("DATABASE_URL", "CELERY_BROKER_URL"):
            env.pop(name, None)
    env.update({"PORT": str(port), "FLOWER_PORT": str(flower_port)})
    return env


class RunningSystem:
    """``scripts/run.py`` in the foreground of its own session, its output collected."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "scripts/run.py"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self.reader = threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True)
        self.reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # Ctrl-C: run.py stops everything it started
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.reader.join(timeout=10)
        return self.process.returncode


@pytest.fixture
def running_system(clean: None, exclusive_workers: None) -> Iterator[tuple[RunningSystem, int]]:
    if shutil.which("curl") is None:
        skip_for_missing("curl", "not on PATH: the README's try-it story needs it")
    port, flower_port = free_port(), free_port()
    system = RunningSystem(_user_env(port, flower_port))
    try:
        yield system, port
    finally:
        rc = system.stop()
        print(f"\nscripts/run.py exited {rc}; its last lines:\n" + "\n".join(system.lines[-15:]))


def _script(steps: list[tryit.Step]) -> str:
    """The story's lines, each between markers that carry its number and exit status; the first
    line that fails ends the script (what comes after depends on it)."""
    out = []
    for number, step in enumerate(steps):
        out.append(f"printf '\\n{MARK} {number} start\\n'")
        out.append(step.line)
        out.append(
            f"rc=$?; printf '\\n{MARK} {number} exit %s\\n' \"$rc\"; [ $rc = 0 ] || exit $rc"
        )
    return "\n".join(out) + "\n"


def _outputs(text: str, count: int) -> dict[int, tuple[str, int | None]]:
    """Each step's output and exit status, parsed from the markers."""
    found: dict[int, tuple[str, int | None]] = {}
    pattern = re.compile(rf"^{MARK} (\d+) start$(.*?)(?:^{MARK} \1 exit (\d+)$|\Z)", re.M | re.S)
    for match in pattern.finditer(text):
        status = None if match.group(3) is None else int(match.group(3))
        found[int(match.group(1))] = (match.group(2).strip("\n"), status)
    assert set(found) <= set(range(count))
    return found


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _shows_in_order(output: str, fragments: tuple[str, ...]) -> bool:
    at = 0
    for fragment in fragments:
        at = output.find(fragment, at)
        if at < 0:
            return False
        at += len(fragment)
    return True


def test_the_readmes_try_it_story_works_as_written(running_system):
    system, port = running_system
    lines = tryit.read()
    steps = tryit.steps(lines)
    assert len(steps) >= 10 and sum(1 for s in steps if s.expect) >= 7
    # given: the system is up and printed the story, line for line
    wait_until(
        lambda: (
            "Reservation cleanup is running" in system.output() or system.process.poll() is not None
        ),
        timeout=120,
        what="run.py's banner",
    )
    assert system.process.poll() is None, system.output()[-3000:]
    wait_until(lambda: lines[-1] in system.lines, timeout=10, what="the story in run.py's output")
    printed = system.lines
    start = printed.index(lines[0])
    assert printed[start : start + len(lines)] == lines
    assert f"export PORT={port}" in printed[:start]  # not 8000: run.py says how to reach it
    # when: the story's lines run, as written, in one bash at the checkout's root
    env = _user_env(port, 0)
    env.pop("FLOWER_PORT")
    began = time.monotonic()
    try:
        proc = subprocess.run(
            ["bash", "--noprofile", "--norc", "-c", _script(steps)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        text, errors = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        text, errors = _text(exc.stdout), f"TIMED OUT after 240 s\n{_text(exc.stderr)}"
    print(f"\nthe story ran in {time.monotonic() - began:.0f} s:\n{text}")
    # then: every line ran and printed what the README says it prints
    outputs = _outputs(text, len(steps))
    for number, step in enumerate(steps):
        output, status = outputs.get(number, ("", None))
        where = f"step {number}: {step.line}\noutput:\n{output}\nstderr:\n{errors[-2000:]}"
        assert status == 0, where
        assert _shows_in_order(output, step.expect), f"expected {step.expect} in order; {where}"
    # and the database agrees, read here and not through the story's own output
    offering = sql(
        "SELECT id, capacity, seats_available FROM reservations_offering WHERE name = %s",
        ["Try-it workshop"],
    )
    assert len(offering) == 1 and offering[0][1:] == (2, 2)
    holds = sql(
        "SELECT id, status, version, released_version FROM reservations_reservation "
        "WHERE offering_id = %s ORDER BY id",
        [offering[0][0]],
    )
    assert [h[1:] for h in holds] == [("released", 1, 1), ("released", 1, 1)]  # no hold for cy
    for hold_id, *_ in holds:
        assert (
            scalar(
                "SELECT count(*) FROM cleanup_cleanupreceipt WHERE reservation_id = %s "
                "AND outcome = 'released' AND version = 1",
                [hold_id],
            )
            == 1
        )
        assert (
            scalar(
                "SELECT count(*) FROM reservations_outboxevent WHERE reservation_id = %s "
                "AND kind = 'reservation.released'",
                [hold_id],
            )
            == 1
        )
    assert scalar("SELECT count(*) FROM cleanup_deadletter") == 0
