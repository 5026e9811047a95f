"""The flash-sale drill: 100,000 holds expiring over 60 s, on its own database and Redis DB.

    .venv/bin/python bench/flash_sale.py default|adaptive|single|batch [--holds N] [--out DIR]
        [burst options]

Creates (or empties) the private database ``reservations_drill`` and Redis DB 6, migrates, and
runs ``manage.py burst`` with the scenario of docs/PERFORMANCE.md ("Flash sale"): 200
offerings, 2 workers × 2 processes started by the drill, 10 % renewed, 5 % duplicated, sweeps
every 2 s. ``default`` leaves CLEANUP_RELEASE_MODE unset (what a user who keeps the defaults
runs: the adaptive mode); ``adaptive``, ``single`` and ``batch`` set it.
The report and plot go to docs/burst/flash-sale-100k-<mode>/ unless --out is given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings.base",
        SECRET_KEY=env.get("SECRET_KEY", "drill-only"),
        RESERVATIONS_API_TOKEN=env.get("RESERVATIONS_API_TOKEN", "drill-only"),
        DATABASE_URL=f"{PG_SERVER}/{DRILL_DB}",
        CELERY_BROKER_URL=BROKER,
        CELERY_TASK_EVENTS="false",
        WORKER_METRICS_PORT="0",
    )
    env.pop("CLEANUP_RELEASE_MODE", None)
    if mode != "default":
        env["CLEANUP_RELEASE_MODE"] = mode
    import psycopg
    import redis

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DRILL_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DRILL_DB}")
    redis.Redis.from_url(BROKER).flushdb()  # the drill's own DB number only
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    out = ["--out", str(ROOT / "docs" / "burst" / f"flash-sale-100k-{mode}")]
    holds = [] if "--holds" in rest else ["--holds", "100000"]
    burst = [*manage, "burst", *holds, *SCENARIO, *(out if "--out" not in rest else []), *rest]
    return subprocess.run(burst, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
