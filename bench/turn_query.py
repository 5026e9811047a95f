"""What the sweeps' turns cost: the query that reads every shard's oldest due hold
(``reservations.services.oldest_due_by_shard``, run once per batch near the queue's cap).

    DATABASE_URL=postgres://…/DB .venv/bin/python bench/turn_query.py [--holds N] [--leased N]

On the (migrated) database of DATABASE_URL — its holds are replaced — it seeds N expired holds
and leases the L oldest (as a full queue's holds in flight are), then prints the plan
(EXPLAIN ANALYZE, BUFFERS) and the median and p99 of 200 runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.base")
os.environ.setdefault("SECRET_KEY", "bench-only")
os.environ.setdefault("RESERVATIONS_API_TOKEN", "bench-only")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--holds", type=int, default=60_000)
    parser.add_argument("--leased", type=int, default=20_000)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()

    import django

    django.setup()
    from django.db import connection
    from django.db.models.functions import Now

    from reservations import services, sql
    from reservations.models import BUCKETS, Offering, Reservation
    from reservations.seed import seed_holds

    Reservation.objects.all().delete()
    Offering.objects.all().delete()
    seed_holds(args.holds, offerings=20, expires_in=lambda p: -120.0 + 60.0 * p / args.holds)
    oldest = list(Reservation.objects.order_by("expires_at").values_list("pk", flat=True))
    Reservation.objects.filter(pk__in=oldest[: args.leased]).update(
        next_attempt_at=Now() + timedelta(seconds=300)
    )
    with connection.cursor() as cur:
        for statement in sql.ANALYZE_HOLDS_AND_OFFERINGS:
            cur.execute(statement)
        params = {"shards": args.shards, "buckets": BUCKETS, "now": None}
        cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql.OLDEST_DUE_BY_SHARD, params)
        print("\n".join(row[0] for row in cur.fetchall()))
    took = []
    for _ in range(200):
        started = time.perf_counter()
        ages = services.oldest_due_by_shard(args.shards)
        took.append((time.perf_counter() - started) * 1000)
    took.sort()
    print(f"ages: { {s: round(a, 1) for s, a in sorted(ages.items())} }")
    print(
        f"{args.holds} expired holds, {args.leased} leased: "
        f"median {statistics.median(took):.2f} ms, p99 {took[int(len(took) * 0.99) - 1]:.2f} ms"
    )


if __name__ == "__main__":
    main()
