"""Where a drain's time goes: ``py-spy record --subprocesses --idle`` on every worker of a
drain, summarized into shares of the pool processes' time by what they were doing.

Used by ``bench/run.py --profile`` (one drain of a release mode, profiled) and by
``bench/flash_sale.py --profile`` (every worker the drill starts). Each sample is one
thread's stack at one instant; a pool process's samples are split by the product or library
frame that says what it was doing (``CATEGORIES``, checked in their order), so the shares are
of the children's wall time, waiting included.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

# (category, pattern on one frame "function (file:line)"): the first category, in this order,
# with a pattern found on any frame of a stack names that stack.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("sweep: publish fan-out", r"publish_release_messages "),
        ("sweep: waiting for the publish lock", r"_acquire_publish_lock "),
        ("sweep: counting the due backlog", r"_eligible_in_all_shards "),
        ("sweep: claim and the rest", r"sweep_shard "),
        ("delivery counter (Redis)", r"\(cleanup/release/delivery_cap\.py"),
        ("argument check (signature bind)", r"^(Signature\.)?bind \(inspect\.py"),
        ("release statement + receipts", r"^release_batch \(cleanup/release/release\.py"),
        ("attempt log line", r"^_log_attempt "),
        ("metrics", r"\(cleanup/metrics\.py"),
        ("dead letters", r"\(cleanup/release/dead_letters\.py"),
        ("waiting for a task", r"recv_bytes \(billiard/connection\.py"),
    )
)
TASK_FRAME = re.compile(r"\((celery/app/trace|celery/app/task)\.py")
PROCESS = re.compile(r"^process (\d+):")
MAIN_IDLE = re.compile(r"^(_?epoll\.poll|poll|select)\b")  # the event loop waiting
# py-spy names methods with their class ("Thread.run") since 0.4; older ones did not.
THREAD = re.compile(r"^(Thread\.)?(run|_bootstrap|_bootstrap_inner) \(threading\.py")


def start(pids: list[int], out: Path, rate: int = 100) -> list[subprocess.Popen[bytes]]:
    """One ``py-spy record`` per worker main process (children included); stop with ``stop``."""
    beside = Path(sys.executable).with_name("py-spy")  # the venv's, when not on PATH
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("py-spy is not installed: pip install -r requirements-dev.txt")
    out.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                spy,
                "record",
                "--subprocesses",
                "--idle",
                "--format",
                "raw",
                "--rate",
                str(rate),
                "--pid",
                str(pid),
                "-o",
                str(out / f"worker-{pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in pids
    ]


def stop(spies: list[subprocess.Popen[bytes]]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for spy in spies:
        spy.wait(60)


def classify(frames: list[str]) -> str:
    for name, rx in CATEGORIES:
        if any(rx.search(frame) for frame in frames):
            return name
    if any(TASK_FRAME.search(frame) for frame in frames):
        return "Celery's task trace (the rest)"
    return "pool process: other (kombu, billiard)"


def summarize(folder: Path, main_pids: list[int]) -> dict[str, Any]:
    """Shares of the pool children's samples by category, and how busy the main processes were."""
    children: Counter[str] = Counter()
    main_busy = main_total = 0
    for path in sorted(folder.glob("worker-*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            parts = stack.split(";")
            pids = [int(m.group(1)) for p in parts if (m := PROCESS.match(p))]
            frames = [p for p in parts if not PROCESS.match(p)]
            if pids and pids[-1] in main_pids:
                main_total += count
                idle = any(MAIN_IDLE.search(f) for f in frames[-1:])
                main_busy += 0 if idle else count
                continue
            if any(THREAD.search(f) for f in frames):
                continue  # a child's helper threads (none do work on the hot path)
            children[classify(frames)] += count
    total = sum(children.values()) or 1
    return {
        "child_samples": sum(children.values()),
        "child_shares": {k: round(v / total, 3) for k, v in children.most_common()},
        "main_busy_share": round(main_busy / main_total, 3) if main_total else None,
    }


def print_summary(summary: dict[str, Any]) -> None:
    print(f"\npool children, {summary['child_samples']} samples (wall time, waiting included)")
    for name, share in summary["child_shares"].items():
        print(f"  {name.ljust(40)} {share:6.1%}")
    if summary["main_busy_share"] is not None:
        print(f"  worker main processes busy: {summary['main_busy_share']:.1%} of their samples")
