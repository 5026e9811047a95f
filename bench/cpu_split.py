"""Where a run's CPU and PostgreSQL's time go: run a command and, until it ends, read every
process's CPU time from /proc each second and PostgreSQL's active backends each 100 ms.

    .venv/bin/python bench/cpu_split.py [--database reservations_drill] [--out FILE] -- COMMAND...

Prints, and writes as JSON to ``--out`` when given: the CPU-seconds each kind of process took
over the run (postgres, redis-server, celery workers, the burst drill, rabbitmq, the rest), and
the mean number of ``--database``'s backends in each state (on the processor or waiting, and on
what) by the first 90 characters of their statement. docs/PERFORMANCE.md ("A million holds in
60 s") reads a flash sale this way. Linux only (/proc)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

PG_SERVER = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
KINDS = (("postgres", "postgres"), ("redis-server", "redis"), ("celery", "workers"),
         ("burst", "drill"), ("beam.smp", "rabbitmq"))  # fmt: skip
ACTIVE = (
    "SELECT backend_type, coalesce(wait_event_type, 'CPU') || ':' || coalesce(wait_event, ''), "
    "left(regexp_replace(query, '\\s+', ' ', 'g'), 90) FROM pg_stat_activity "
    "WHERE state = 'active' AND pid <> pg_backend_pid() AND (datname = %s OR datname IS NULL)"
)


def cpu_seconds() -> dict[str, tuple[str, float]]:
    """Each live process's kind and CPU-seconds so far (user + system), by pid."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[str, tuple[str, float]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, UnicodeDecodeError):
            continue
        kind = next((name for marker, name in KINDS if marker in cmdline), "other")
        found[pid] = (kind, (int(stat[11]) + int(stat[12])) / tick)
    return found


def sample_backends(database: str, stop: threading.Event, seen: collections.Counter) -> int:
    """Count ``database``'s active backends by state and statement every 100 ms until ``stop``;
    return the number of samples."""
    samples = 0
    while not stop.is_set():
        try:
            with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
                while not stop.is_set():
                    for kind, state, query in conn.execute(ACTIVE, [database]).fetchall():
                        text = query if kind == "client backend" else f"({kind})"
                        seen[f"{state} | {text}"] += 1
                    samples += 1
                    time.sleep(0.1)
        except psycopg.OperationalError:  # the drill drops and creates its database
            time.sleep(0.5)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", default="reservations_drill")
    parser.add_argument("--out", type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    before = cpu_seconds()
    last = dict(before)
    seen: collections.Counter[str] = collections.Counter()
    stop = threading.Event()
    counted: list[int] = []
    sampler = threading.Thread(
        target=lambda: counted.append(sample_backends(args.database, stop, seen)), daemon=True
    )
    sampler.start()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        last.update(cpu_seconds())  # a process that ends keeps its last reading
        time.sleep(1)
    stop.set()
    sampler.join(10)
    cpu: dict[str, float] = collections.defaultdict(float)
    for pid, (kind, seconds) in last.items():
        cpu[kind] += seconds - before.get(pid, (kind, 0.0))[1]
    samples = max(1, counted[0] if counted else 1)
    report = {
        "command": command,
        "returncode": proc.returncode,
        "cpu_seconds": {kind: round(s, 1) for kind, s in sorted(cpu.items())},
        "backend_samples": samples,
        "mean_active_backends": {k: round(v / samples, 3) for k, v in seen.most_common(25)},
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
