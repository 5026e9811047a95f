"""Start and stop real ``celery worker`` processes (the burst drill, the benchmarks and the
tests; the tests' ``celery beat`` processes are the same kind of child).

Each worker is its own process group, so a SIGKILL takes its pool children too, exactly as a
lost node would. Only processes started here are ever signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[2]  # the project (manage.py, config/)


def celery_bin() -> str:
    return str(Path(sys.executable).with_name("celery"))


class CeleryProcess:
    """A ``celery -A config …`` child of this process, in a session (process group) of its own,
    its output appended to ``log_path``. Subclasses say what follows ``celery -A config`` and
    with which environment."""

    name: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None
    # Where this start's output begins in ``log_path`` (a restart appends to the same file).
    log_offset: int = 0

    def celery_args(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    def command(self) -> list[str]:
        return [celery_bin(), "-A", "config", *self.celery_args()]

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.log_offset = log.tell()
        self.proc = subprocess.Popen(
            self.command(),
            cwd=ROOT,
            env=self.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """Warm shutdown (SIGTERM): a worker finishes the running task and restores prefetched
        ones."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group: the main process and its children (a worker's pool)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def log_output(self) -> bytes:
        """What this start of the process has written (not an earlier start's lines)."""
        with self.log_path.open("rb") as log:
            log.seek(self.log_offset)
            return log.read()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class WorkerProcess(CeleryProcess):
    name: str
    concurrency: int
    log_path: Path
    # Empty: every queue of the worker's settings (``CELERY_TASK_QUEUES``: sweep, release,
    # maintenance, named by the CLEANUP_*_QUEUE settings of its settings module).
    queues: str = ""
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    def celery_args(self) -> list[str]:
        return [
            "worker",
            *(["-Q", self.queues] if self.queues else []),
            "-c",
            str(self.concurrency),
            "-n",
            f"{self.name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "INFO",
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"worker {self.name} exited:\n{self.log_tail()}")
            if b" ready." in self.log_output():
                return
            time.sleep(0.2)
        raise TimeoutError(f"worker {self.name} not ready in {timeout}s:\n{self.log_tail()}")

    def children(self) -> list[int]:
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def memory(self) -> dict[str, dict[str, int]]:
        """VmHWM (peak RSS) and VmRSS in kB of the main process and each pool child."""
        out: dict[str, dict[str, int]] = {}
        for label, pid in [("main", self.pid)] + [(f"child-{p}", p) for p in self.children()]:
            values: dict[str, int] = {}
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    key, _, rest = line.partition(":")
                    if key in ("VmHWM", "VmRSS"):
                        values[key] = int(rest.split()[0])
            except OSError:
                continue
            out[label] = values
        return out
