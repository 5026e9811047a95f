"""What a /metrics scrape costs the database at 10 million released holds and 1 million held, with
every scrape reading the eligible backlog and with the fleet's one reading per interval, in one
run.

    .venv/bin/python bench/slo_scrape.py [--released 10000000] [--held 1000000] [--shards 4]
        [--scrapes 30]

Private database ``reservations_slo`` (created, migrated and seeded here; kept for the next run,
re-seeded only when its row counts differ). The held holds expire evenly over the hour around
the run (half are eligible, about 125,000 per shard at 4 shards: above the count cap of
100,000). Three arms take turns, in a new random order each round:

- ``every scrape reads``: the eligible section with ``CLEANUP_ELIGIBLE_READING_SECONDS`` = 0, as
  every scrape of every web process ran it before;
- ``fleet reading, exported``: what every other scrape of the fleet does (the reading is fresh);
- ``fleet reading, taken``: the one scrape per interval that takes the lease, reads and stores.

It also times a whole scrape (every section) of each kind. Prints a table and the database time a
fleet of web replicas spends per minute either way; writes reports/bench/slo-scrape-<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, not the project
    sys.path.insert(0, str(ROOT))

from bench.paths import RESULTS, STAMP  # noqa: E402

PG_SERVER = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
DATABASE = f"{PG_SERVER}/reservations_slo"
BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/5")
ARMS = ("every scrape reads", "fleet reading, exported", "fleet reading, taken")
# The fleet the per-minute figure is stated for: 3 web replicas, each scraped every 15 s
# (Prometheus' usual interval) by two Prometheus servers (a highly available pair).
REPLICAS, SCRAPES_PER_MINUTE_PER_REPLICA = 3, 2 * 60 / 15

SEED = """
INSERT INTO reservations_reservation (offering_id, holder, status, expires_at, next_attempt_at,
    version, released_version, claim_count, last_trace_id, created_at, updated_at, released_at,
    release_reason)
SELECT %(offering)s + n %% 1000, 'slo-bench', %(status)s,
       now() + make_interval(secs => %(from_s)s + (n::float8 / %(count)s) * %(span_s)s),
       now() + make_interval(secs => %(from_s)s + (n::float8 / %(count)s) * %(span_s)s),
       1, %(released_version)s, 0, '', now(), now(), %(released_at)s, %(reason)s
FROM generate_series(%(start)s, %(stop)s) AS n
"""


def seed(released: int, held: int) -> dict[str, float]:
    """Make the table hold exactly ``released`` released and ``held`` held holds (in chunks of
    a million rows, each its own transaction), then VACUUM ANALYZE. Returns seconds spent."""
    from django.db import connection
    from django.db.models import Count

    from reservations.models import Offering, Reservation

    counts = dict(Reservation.objects.values_list("status").annotate(n=Count("id")))
    if counts.get("released", 0) == released and counts.get("held", 0) == held:
        return {}
    started = time.perf_counter()
    with connection.cursor() as cur:
        cur.execute("TRUNCATE reservations_reservation, reservations_outboxevent CASCADE")
    Offering.objects.all().delete()
    first = Offering.objects.bulk_create(
        Offering(name=f"slo-{i}", capacity=10**7, seats_available=0) for i in range(1000)
    )[0].pk
    chunk = 1_000_000
    for status, count, from_s, span_s in (
        ("released", released, -30 * 86400.0, 30 * 86400.0),  # a month of released holds
        ("held", held, -1800.0, 3600.0),  # the hour around the run: half eligible
    ):
        for start in range(0, count, chunk):
            with connection.cursor() as cur:
                cur.execute(
                    SEED,
                    {
                        "offering": first,
                        "status": status,
                        "count": count,
                        "from_s": from_s,
                        "span_s": span_s,
                        "released_version": 1 if status == "released" else None,
                        "released_at": None,
                        "reason": "expired" if status == "released" else "",
                        "start": start,
                        "stop": min(count, start + chunk) - 1,
                    },
                )
            print(f"  seeded {status} {min(count, start + chunk):,}/{count:,}", flush=True)
    seeded = time.perf_counter() - started
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE reservations_reservation")
    return {
        "seed_s": round(seeded, 1),
        "vacuum_s": round(time.perf_counter() - started - seeded, 1),
    }


def measure(shards: int, scrapes: int) -> dict[str, Any]:
    from django.db import connection
    from django.test import override_settings

    from cleanup.models import BacklogReading
    from cleanup.operations.console.gauges import BacklogCollector
    from cleanup.release.schedule import install_schedule

    install_schedule(shards, 10)
    collector = BacklogCollector()

    def eligible(arm: str) -> float:
        if arm == "fleet reading, taken":
            BacklogReading.objects.all().delete()  # the next scrape takes the lease and reads
        interval = 0 if arm == "every scrape reads" else 3600
        with override_settings(CLEANUP_ELIGIBLE_READING_SECONDS=interval):
            started = time.perf_counter()
            collector.read_eligible()
            return time.perf_counter() - started

    def whole(arm: str) -> float:
        if arm == "fleet reading, taken":
            BacklogReading.objects.all().delete()
        interval = 0 if arm == "every scrape reads" else 3600
        with override_settings(CLEANUP_ELIGIBLE_READING_SECONDS=interval):
            started = time.perf_counter()
            collector.refresh()
            return time.perf_counter() - started

    # warm the caches and take one reading, so that "exported" finds one
    for arm in ARMS:
        eligible(arm)
    readings = collector.read_eligible()
    timings: dict[str, dict[str, list[float]]] = {"eligible": {}, "whole": {}}
    for kind in timings:
        timings[kind] = {arm: [] for arm in ARMS}
    for _ in range(scrapes):
        for arm in random.sample(ARMS, len(ARMS)):
            timings["eligible"][arm].append(eligible(arm))
            timings["whole"][arm].append(whole(arm))
    with connection.cursor() as cur:
        cur.execute("SELECT pg_total_relation_size('reservations_reservation')")
        table_bytes = cur.fetchone()[0]
    return {
        "shards": shards,
        "scrapes_per_arm": scrapes,
        "table_gib": round(table_bytes / 2**30, 2),
        "gauges": {name: [value for _, value in samples] for name, samples in readings.items()},
        "ms": {
            kind: {
                arm: {
                    "median": round(statistics.median(ts) * 1000, 3),
                    "p90": round(sorted(ts)[int(len(ts) * 0.9) - 1] * 1000, 3),
                }
                for arm, ts in by_arm.items()
            }
            for kind, by_arm in timings.items()
        },
    }


def fleet_per_minute(ms: dict[str, dict[str, float]], interval_s: float) -> dict[str, float]:
    """Database milliseconds per minute of the eligible section for the fleet above: every
    scrape reading, against one reading per interval plus the others exporting it."""
    scrapes = REPLICAS * SCRAPES_PER_MINUTE_PER_REPLICA
    readings = 60 / interval_s
    before = scrapes * ms["every scrape reads"]["median"]
    after = (
        readings * ms["fleet reading, taken"]["median"]
        + max(0.0, scrapes - readings) * ms["fleet reading, exported"]["median"]
    )
    return {
        "scrapes_per_minute": scrapes,
        "every_scrape_reads_ms_per_minute": round(before, 1),
        "fleet_reading_ms_per_minute": round(after, 1),
        "ratio": round(after / before, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--released", type=int, default=10_000_000)
    parser.add_argument("--held", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--scrapes", type=int, default=30)
    args = parser.parse_args()
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "config.settings.base",
            "DATABASE_URL": DATABASE,
            "CELERY_BROKER_URL": BROKER,
        }
    )
    os.environ.setdefault("SECRET_KEY", "bench-only")
    os.environ.setdefault("RESERVATIONS_API_TOKEN", "bench-only")
    from bench.migrated import ensure_migrated_database

    ensure_migrated_database(DATABASE)
    import django

    django.setup()
    from cleanup.conf import cleanup_settings

    print(f"seeding {args.released:,} released and {args.held:,} held holds (if needed)")
    seeding = seed(args.released, args.held)
    result = measure(args.shards, args.scrapes)
    interval = float(cleanup_settings().eligible_reading_seconds)
    result["fleet"] = fleet_per_minute(result["ms"]["eligible"], interval)
    report = {
        "bench": "slo_scrape",
        "released": args.released,
        "held": args.held,
        "interval_s": interval,
        "seeding": seeding,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **result,
    }
    print(
        f"\n{args.released:,} released, {args.held:,} held, {args.shards} shards, "
        f"{result['table_gib']} GiB, {args.scrapes} scrapes per arm (median / p90 ms)"
    )
    print(f"{'':28}{'eligible section':>22}{'whole scrape':>22}")
    for arm in ARMS:
        e, w = result["ms"]["eligible"][arm], result["ms"]["whole"][arm]
        row = f"{e['median']:>12.2f} / {e['p90']:<7.2f}{w['median']:>12.2f} / {w['p90']:<7.2f}"
        print(f"{arm:28}{row}")
    f = result["fleet"]
    print(
        f"\n{REPLICAS} replicas scraped {SCRAPES_PER_MINUTE_PER_REPLICA:.0f}×/min each: the "
        f"eligible section costs {f['every_scrape_reads_ms_per_minute']:.0f} ms/min when every "
        f"scrape reads, {f['fleet_reading_ms_per_minute']:.0f} ms/min with one reading per "
        f"{interval:g} s (× {f['ratio']})"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(RESULTS) / f"slo-scrape-{STAMP}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
