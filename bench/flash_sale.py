"""The flash-sale drill: 100,000 holds expiring over 60 s, on its own database and Redis DB.

    .venv/bin/python bench/flash_sale.py default|adaptive|single|batch [--holds N] [--out DIR]
        [--profile DIR] [burst options]

Creates (or empties) the private database ``reservations_drill`` and Redis DB 6, migrates, and
runs ``manage.py burst`` with the scenario of docs/PERFORMANCE.md ("The flash-sale drain"): 200
offerings, 2 workers × 2 processes started by the drill, 10 % renewed, 5 % duplicated, sweeps
every 2 s. ``default`` leaves the release mode (the Django setting CLEANUP_RELEASE_MODE) at its
default (what a user who keeps the defaults runs: the adaptive mode); ``adaptive``, ``single``
and ``batch`` set it, in the drill's settings (bench/arms.py).
The report and plot go to reports/burst/flash-sale-100k-<mode>/ (git-ignored) unless --out
is given.

``--profile DIR``: ``py-spy record --subprocesses --idle`` on each worker the drill starts
(``bench.profile``); the raw stacks and ``profile.json`` (shares of the pool processes' wall
time by what they were doing) go to DIR, and the shares are printed at the end. py-spy takes
part of the two cores: a profiled run shows where the time goes, not the drill's numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, not the project
    sys.path.insert(0, str(ROOT))

from bench.arms import events, settings_env  # noqa: E402

PG_SERVER = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
DRILL_DB = "reservations_drill"
BROKER = os.environ.get("DRILL_BROKER", "redis://127.0.0.1:6379/6")
SCENARIO = [
    "--window", "60", "--offerings", "200", "--workers", "2", "--concurrency", "2",
    "--renew-fraction", "0.1", "--duplicate-fraction", "0.05", "--sweep-every", "2",
]  # fmt: skip


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("default", "adaptive", "single", "batch"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, rest = sys.argv[1], sys.argv[2:]
    profile_to: Path | None = None
    if "--profile" in rest:
        at = rest.index("--profile")
        if at + 1 >= len(rest):
            print("--profile needs a directory", file=sys.stderr)
            return 2
        profile_to = Path(rest[at + 1]).resolve()
        del rest[at : at + 2]
    env = dict(os.environ)
    env.update(
        SECRET_KEY=env.get("SECRET_KEY", "drill-only"),
        RESERVATIONS_API_TOKEN=env.get("RESERVATIONS_API_TOKEN", "drill-only"),
        DATABASE_URL=f"{PG_SERVER}/{DRILL_DB}",
        CELERY_BROKER_URL=BROKER,
        WORKER_METRICS_PORT="0",
    )
    chosen = events(False) | ({} if mode == "default" else {"CLEANUP_RELEASE_MODE": mode})
    env.update(settings_env(chosen))
    import psycopg
    import redis

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DRILL_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DRILL_DB}")
    redis.Redis.from_url(BROKER).flushdb()  # the drill's own DB number only
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    out = ["--out", str(ROOT / "reports" / "burst" / f"flash-sale-100k-{mode}")]
    holds = [] if "--holds" in rest else ["--holds", "100000"]
    count = int(rest[rest.index("--holds") + 1]) if "--holds" in rest else 100_000
    # The set-based release beside the drain, over as many holds (at most 100,000: enough for
    # a steady rate, and seeded in seconds).
    ceiling = [] if "--set-based" in rest else ["--set-based", str(min(count, 100_000))]
    burst = [
        *manage, "burst", *holds, *SCENARIO, *ceiling,
        *(out if "--out" not in rest else []), *rest,
    ]  # fmt: skip
    if profile_to is None:
        return subprocess.run(burst, cwd=ROOT, env=env).returncode
    return _profiled(burst, env, profile_to)


def _worker_pids(parent: int) -> list[int]:
    """The celery worker main processes started by the drill (children of its process)."""
    found = []
    for task in Path(f"/proc/{parent}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"worker" in cmdline and any(part.endswith(b"celery") for part in cmdline):
                found.append(int(child))
    return found


def _profiled(burst: list[str], env: dict[str, str], folder: Path) -> int:
    """Run the drill with py-spy on each of its workers from the moment it starts."""
    sys.path.insert(0, str(ROOT))  # run as a script: ``bench`` is a folder beside it
    from bench import profile

    drill = subprocess.Popen(burst, cwd=ROOT, env=env)
    spies: list[subprocess.Popen[bytes]] = []
    watched: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            new = [pid for pid in _worker_pids(drill.pid) if pid not in watched]
            if new:
                watched.update(new)
                spies.extend(profile.start(new, folder))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        returncode = drill.wait()
    finally:
        done.set()
        watcher.join(5)
        profile.stop(spies)
    summary = profile.summarize(folder, sorted(watched))
    (folder / "profile.json").write_text(json.dumps(summary, indent=2) + "\n")
    profile.print_summary(summary)
    return returncode


if __name__ == "__main__":
    raise SystemExit(main())
