"""The bench's own database (``reservations_bench``) and the measurements that need no worker:
commit latency, the set-based release CTE, a one-process psycopg loop, and the sweep claim's cost
on a small and a large table."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from django.db import connection, transaction

from bench.paths import RESULTS, ROOT, STAMP
from cleanup.broker.readers import redis_client
from cleanup.release import claim
from reservations.db import rows as sql
from reservations.eligibility import eligible_sql
from tools.drills.set_based import RELEASE_WITH_RECEIPTS, release_all, release_params
from tools.seed import seed_holds

BENCH_DB = "reservations_bench"

TABLES = (
    "cleanup_cleanupreceipt, cleanup_deadletter, cleanup_deliverycount, "
    "reservations_outboxevent, reservations_reservation, reservations_offering"
)


def reset() -> None:
    redis_client().flushdb()  # our own DB number only
    sql(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")


def create_holds(eligible: int, *, offerings: int = 8, other: int = 0) -> None:
    """``eligible`` expired holds over ``offerings`` (seats accounted), plus ``other`` rows that
    are not eligible: released, confirmed, or held with a future expiry (1/3 each)."""
    seed_holds(eligible, offerings=offerings, expires_in=-60.0, name="bench", analyze=False)
    if other:
        oid = sql(
            "INSERT INTO reservations_offering (name, capacity, seats_available, created_at) "
            "VALUES ('bench-other', %s, 0, now()) RETURNING id",
            [other],
        )[0][0]
        sql(
            "INSERT INTO reservations_reservation (offering_id, holder, status, expires_at, "
            "next_attempt_at, version, claim_count, last_trace_id, created_at, updated_at, "
            "release_reason, released_version, released_at) "
            "SELECT %(o)s, 'o' || g, s.status, "
            "CASE WHEN s.status = 'held' THEN now() + interval '1 day' "
            "ELSE now() - interval '1 day' END, "
            "CASE WHEN s.status = 'held' THEN now() + interval '1 day' "
            "ELSE now() - interval '1 day' END, "
            "2, 1, '', now(), now(), '', "
            "CASE WHEN s.status = 'released' THEN 2 END, "
            "CASE WHEN s.status = 'released' THEN now() - interval '1 day' END "
            "FROM generate_series(1, %(n)s) g, "
            "LATERAL (SELECT (ARRAY['released','confirmed','held'])[g %% 3 + 1] AS status) s",
            {"o": oid, "n": other},
        )
        # capacity = held + confirmed for that offering
        sql(
            "UPDATE reservations_offering SET capacity = (SELECT count(*) FROM "
            "reservations_reservation WHERE offering_id = %s AND status IN ('held','confirmed')) "
            "WHERE id = %s",
            [oid, oid],
        )
    sql("ANALYZE reservations_reservation")
    sql("ANALYZE reservations_offering")


def eligible_count() -> int:
    return int(sql(f"SELECT count(*) FROM reservations_reservation WHERE {eligible_sql()}")[0][0])


def released_count() -> int:
    return int(sql("SELECT count(*) FROM reservations_reservation WHERE status = 'released'")[0][0])


def any_held() -> bool:
    """Whether any hold is still held: the drains' poll, every 20 ms. One probe of the partial
    held index (~0.2 ms), where counting the released rows read the whole table each time
    (2.5 ms at 20,000 rows, and more as released rows pile up): 50 of those a second took an
    eighth of a core from the drain they were timing."""
    held = "SELECT EXISTS (SELECT 1 FROM reservations_reservation WHERE status = 'held')"
    return bool(sql(held)[0][0])


def check(expected: int) -> list[str]:
    from tools.drills.invariants import invariant_violations

    problems = invariant_violations()
    if released_count() != expected:
        problems.append(f"released {released_count()} of {expected}")
    return problems


def commit_latency(n: int = 300) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_commit (id serial, t timestamptz)")
        times = []
        for _ in range(n):
            t = time.perf_counter()
            conn.execute("INSERT INTO bench_commit (t) VALUES (now())")
            times.append(time.perf_counter() - t)
        conn.execute("DROP TABLE bench_commit")
    return {
        "inserts": n,
        "mean_ms": round(statistics.mean(times) * 1000, 3),
        "median_ms": round(statistics.median(times) * 1000, 3),
        "tps": round(n / sum(times), 1),
    }


ELIGIBLE_HOLDS = f"SELECT id, version FROM reservations_reservation WHERE {eligible_sql()}"


def set_based(holds: int) -> dict[str, Any]:
    """Every eligible hold released by one run of the product's release statement (receipts
    attached): the ceiling a drain's per-message work is compared with."""
    reset()
    create_holds(holds)
    eligible = [(int(rid), int(version)) for rid, version in sql(ELIGIBLE_HOLDS)]
    released, elapsed = release_all(eligible, "bench-set")
    receipts, events = sql(
        "SELECT (SELECT count(*) FROM cleanup_cleanupreceipt), "
        "(SELECT count(*) FROM reservations_outboxevent WHERE kind = 'reservation.released')"
    )[0]
    return {
        "holds": holds,
        "released": released,
        "receipts": receipts,
        "events": events,
        "seconds": round(elapsed, 3),
        "rate": round(released / elapsed, 1),
        "violations": check(holds),
    }


def psycopg_loop(holds: int, rows: int) -> dict[str, Any]:
    """The product's release statement (receipt attached) once per hold, each its own
    transaction, bare psycopg, one process: the floor of per-hold work without Celery."""
    import psycopg

    reset()
    create_holds(holds)
    ids = sql(
        "SELECT id, version FROM reservations_reservation WHERE status = 'held' "
        "ORDER BY id LIMIT %s",
        [rows],
    )
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        t = time.perf_counter()
        for rid, version in ids:
            with conn.transaction():
                released = conn.execute(
                    RELEASE_WITH_RECEIPTS, release_params([(rid, version)], "bench-loop")
                ).fetchall()
                assert len(released) == 1
        elapsed = time.perf_counter() - t
    return {
        "rows": len(ids),
        "seconds": round(elapsed, 3),
        "rate": round(len(ids) / elapsed, 1),
        "violations": check(len(ids)),
    }


class _Rollback(Exception):
    pass


def sweep_cost(small: int, large: int, eligible: int, batch: int) -> dict[str, Any]:
    """Time one claim of ``batch`` (rolled back) with the same eligible set on a table of
    ``small`` vs ``large`` rows; save EXPLAIN (ANALYZE, BUFFERS)."""
    out: dict[str, Any] = {}
    for label, total in (("small", small), ("large", large)):
        reset()
        create_holds(eligible, other=total - eligible)
        times = []
        claimed = 0
        for _ in range(7):
            try:
                with transaction.atomic():
                    t = time.perf_counter()
                    claimed = len(
                        claim.claim_expired(
                            0, 4, batch_size=batch, lease_seconds=300, max_claims=10
                        )
                    )
                    times.append(time.perf_counter() - t)
                    raise _Rollback
            except _Rollback:
                pass
        # EXPLAIN exactly the statement claim_expired runs (captured, whatever its SQL is now).
        captured: list[tuple[str, Any]] = []

        def capture(
            execute: Any,
            query: str,
            qparams: Any,
            many: bool,
            context: Any,
            sink: list[tuple[str, Any]] = captured,
        ) -> Any:
            sink.append((query, qparams))
            return execute(query, qparams, many, context)

        plan = ""
        try:
            with transaction.atomic():
                with connection.execute_wrapper(capture):
                    claim.claim_expired(0, 4, batch_size=batch, lease_seconds=300, max_claims=10)
                raise _Rollback
        except _Rollback:
            pass
        try:
            with transaction.atomic():
                query, qparams = captured[-1]
                plan = "\n".join(r[0] for r in sql("EXPLAIN (ANALYZE, BUFFERS) " + query, qparams))
                raise _Rollback
        except _Rollback:
            pass
        path = RESULTS / f"{STAMP}-explain-claim-{total}.txt"
        path.write_text(plan + "\n")
        out[label] = {
            "rows": total,
            "eligible": eligible,
            "batch": batch,
            "claimed": claimed,
            "median_ms": round(statistics.median(times) * 1000, 2),
            "min_ms": round(min(times) * 1000, 2),
            "explain": str(path.relative_to(ROOT)),
        }
    out["ratio"] = round(out["large"]["median_ms"] / out["small"]["median_ms"], 2)
    return out
