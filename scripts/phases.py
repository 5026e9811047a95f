"""The plumbing under noxfile.py: timings, lanes of sessions run beside each other, the list of
what a run left out, Debian packages installed in CI, and each pytest's own database and broker.

Nothing here knows the sessions: noxfile.py says what runs, in which lane and on which server.
Standard library only: the noxfile imports it with whichever Python runs nox.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

MISSING_TOOLS_FILE = "RESERVATIONS_MISSING_TOOLS_FILE"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def say(message: str) -> None:
    print(message, flush=True)


interrupted = False


def interrupt_children() -> None:
    """SIGINT to this process's children, as Ctrl-C at a terminal sends it to its command (a
    SIGTERM to nox reaches nox alone, which would otherwise wait for the command to finish)."""
    global interrupted
    interrupted = True
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGINT)


def apt_install(*packages: str) -> bool:
    """Install Debian packages (no recommends; ``apt-get update`` once on failure). Only as root
    with apt-get; False when they could not be installed."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    say(f"installing the Debian package(s) {' '.join(packages)}")

    def quietly(*command: str) -> bool:
        done = subprocess.run(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
        )
        return done.returncode == 0

    install = ("apt-get", "install", "-y", "--no-install-recommends", *packages)
    return quietly(*install) or (quietly("apt-get", "update") and quietly(*install))


def parse_exports(text: str) -> dict[str, str]:
    """The ``export NAME=value`` lines the service scripts print, as a mapping."""
    found = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            found[name] = value
    return found


def with_database_suffix(url: str, suffix: str) -> str:
    """``DATABASE_URL`` naming the database + ``suffix`` (pytest-django creates test_<that>)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=parts.path + suffix))


def redis_database_plus(url: str, offset: int) -> str:
    """A Redis URL naming the database ``offset`` numbers further on (13 + 1 -> 14)."""
    parts = urlsplit(url)
    number = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(number + offset) % 16}"))


def iptables_in_namespace() -> str:
    """Whether iptables can add a rule inside a network namespace, switching Debian's iptables
    to the legacy backend where the kernel lacks nf_tables (the default backend)."""
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    namespace = f"citest{os.getpid()}"

    def quietly(*command: str) -> bool:
        return subprocess.run(command, capture_output=True, check=False).returncode == 0

    def add_rule() -> bool:
        rule = ("iptables", "-A", "OUTPUT", "-p", "tcp", "--dport", "9", "-j", "DROP")
        return quietly("ip", "netns", "exec", namespace, *rule)

    if not quietly("ip", "netns", "add", namespace):
        return "no network namespace could be made here (the drills that need one will say so)"

    def works() -> str:
        version = subprocess.run(["iptables", "-V"], capture_output=True, text=True, check=False)
        return f"iptables in a network namespace: {version.stdout.strip()}"

    try:
        if add_rule():
            return works()
        legacy = ("update-alternatives", "--set", "iptables", "/usr/sbin/iptables-legacy")
        if quietly(*legacy) and add_rule():
            return f"{works()} (switched to the legacy backend)"
        return "iptables cannot add a rule in a network namespace here: the partition drills fail"
    finally:
        quietly("ip", "netns", "delete", namespace)


# --- What a run left out -------------------------------------------------------------------


class LeftOut:
    """The file every process of one run appends its "left out" lines to (pytest's skips for
    missing tools, tests/support/missing_tools.py, and the phases' own). The process that creates it
    (the outermost nox) prints it at the end and removes it; lanes and the pytest runs they
    start inherit its name through the environment."""

    def __init__(self) -> None:
        self.owned: Path | None = None
        self.printed = False

    def ensure(self) -> None:
        if os.environ.get(MISSING_TOOLS_FILE):
            return
        handle, name = tempfile.mkstemp(prefix="left-out-")
        os.close(handle)
        self.owned = Path(name)
        os.environ[MISSING_TOOLS_FILE] = name
        atexit.register(self._at_exit)

    def add(self, *words: str) -> None:
        self.ensure()
        with open(os.environ[MISSING_TOOLS_FILE], "a", encoding="utf-8") as out:
            out.write(" ".join(words) + "\n")

    def report(self) -> None:
        """Print what was left out (only where the list was made: the run's outermost nox)."""
        if self.owned is None:
            return
        self.printed = True
        lines = sorted(set(self.owned.read_text(encoding="utf-8").splitlines()) - {""})
        if lines:
            say("==> left out of this run (a partial run: install what is missing, or run CI)")
            say("\n".join(lines))

    def _at_exit(self) -> None:
        if self.owned is None:
            return
        if not self.printed:
            self.report()
        self.owned.unlink(missing_ok=True)


# --- Timings and lanes ---------------------------------------------------------------------


@dataclass
class Timings:
    lines: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def add(self, name: str, seconds: float, failure: str | None, beside: bool = False) -> None:
        outcome = "ok" if failure is None else f"FAILED ({failure}"
        if beside:
            outcome += "; beside other phases" if failure else " (beside other phases)"
        if failure:
            outcome += ")"
        self.lines.append(f"{name}: {round(seconds)}s {outcome}")

    def report(self) -> None:
        say("==> timings")
        say("\n".join(self.lines))
        say(f"total: {round(time.monotonic() - self.started)}s")


@dataclass
class _Lane:
    sessions: list[str]
    where: Path  # its output and nox's JSON report
    process: subprocess.Popen[bytes]


class Lanes:
    """Lanes of nox sessions run beside the caller, each lane one nox process running its
    sessions one after another (every one, even when one before it failed). A lane's output is
    kept in a file and printed whole when the lane is finished, so two lanes' lines never
    interleave; its sessions' times come from nox's JSON report."""

    def __init__(self, timings: Timings, nox: list[str]) -> None:
        self.timings = timings
        self.nox = nox
        self.lanes: dict[str, _Lane] = {}

    def start(self, name: str, sessions: Sequence[str]) -> None:
        if not self.lanes:  # registered after the services' exit handler, so it runs first
            atexit.register(self.stop)
        where = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        command = [*self.nox, "--report", str(where / "report.json"), "--sessions", *sessions]
        names = ", ".join(sessions)
        say(f"==> {names} (beside the next phases, one after another; output when they end)")
        with open(where / "output.log", "wb") as log:
            # A process group of its own: stop() interrupts the lane's nox and its command
            # together, as Ctrl-C at a terminal does.
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.lanes[name] = _Lane(list(sessions), where, process)

    def finish(self, name: str) -> bool:
        """Wait for the lane, print its output and its sessions' times; False when one failed."""
        lane = self.lanes.pop(name)
        returncode = lane.process.wait()
        say(f"==> {', '.join(lane.sessions)} (output)")
        sys.stdout.write((lane.where / "output.log").read_text(errors="replace"))
        sys.stdout.flush()
        report = lane.where / "report.json"
        results = json.loads(report.read_text())["sessions"] if report.exists() else []
        by_name = {result["name"]: result for result in results}
        for session in lane.sessions:
            result = by_name.get(session, {"result": "not run", "duration": 0.0, "reason": None})
            failure = None
            if result["result"] not in ("success", "skipped"):
                failure = " ".join(filter(None, [f"session {result['result']}", result["reason"]]))
            self.timings.add(session, result["duration"], failure, beside=True)
        shutil.rmtree(lane.where, ignore_errors=True)
        return returncode == 0

    def finish_all(self) -> bool:
        results = [self.finish(name) for name in list(self.lanes)]
        return all(results)

    def stop(self) -> None:
        """At exit (Ctrl-C, SIGTERM) with lanes still running: interrupt them as Ctrl-C would
        (90 s to stop their workers, then killed)."""
        running = [lane for lane in self.lanes.values() if lane.process.poll() is None]
        for lane in running:
            say(f"interrupting {', '.join(lane.sessions)} (pid {lane.process.pid}), beside")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(lane.process.pid, signal.SIGINT)
        for lane in running:
            try:
                lane.process.wait(90)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(lane.process.pid, signal.SIGKILL)
        for lane in self.lanes.values():
            shutil.rmtree(lane.where, ignore_errors=True)
