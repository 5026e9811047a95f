"""Benchmarks: the product's release paths side by side with the physical limits, in one run.

    .venv/bin/python bench/run.py [--holds 20000] [--rss-tasks 100000] [--quick]

Private database ``reservations_bench`` (created and migrated here) and private Redis DB 5 (only
that DB is ever flushed). Prints a table with ratios; writes reports/bench/<timestamp>.json and
the sweep's EXPLAIN output next to it. Performance targets live here, never in unit tests.
Nothing happens at import: ``main()`` creates the database, sets up Django, then runs
``bench/measures.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, not the project
    sys.path.insert(0, str(ROOT))

from bench.arms import ROUTES, SETTINGS_MODULE, VARIABLE, events  # noqa: E402

PG_SERVER = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
BENCH_DB = "reservations_bench"
BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/5")

ENV = {
    "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
    VARIABLE: json.dumps(events(False) | ROUTES),
    "SECRET_KEY": "bench-only",
    "RESERVATIONS_API_TOKEN": "bench-only",
    "DATABASE_URL": f"{PG_SERVER}/{BENCH_DB}",
    "CELERY_BROKER_URL": BROKER,
    "CLEANUP_MAX_QUEUE_DEPTH": "1000000",
    "WORKER_METRICS_PORT": "0",
}
# Always the bench's own settings module, database and broker; the rest unless already set.
FORCED = ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "CELERY_BROKER_URL")


def main() -> int:
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ or k in FORCED})
    from bench.migrated import ensure_migrated_database

    ensure_migrated_database(ENV["DATABASE_URL"])
    import django

    django.setup()
    # After django.setup(): the measurements import models at module level.
    from bench import measures

    return measures.main()


if __name__ == "__main__":
    raise SystemExit(main())
