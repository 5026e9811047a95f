"""The measurements behind ``bench/run.py`` (which prepares the database and Django first).

Private database ``reservations_bench`` (created and migrated here) and private Redis DB 5 (only
that DB is ever flushed). Prints a table with ratios; writes bench/results/<timestamp>.json and
the sweep's EXPLAIN output next to it. Performance targets live here, never in unit tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.db import connection, transaction

from bench import profile
from cleanup.broker import redis_client
from cleanup.drills.workers import WorkerProcess
from reservations import services
from reservations.seed import seed_holds

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BENCH_DB = "reservations_bench"

TABLES = (
    "cleanup_cleanupreceipt, cleanup_deadletter, cleanup_deliverycount, "
    "reservations_outboxevent, reservations_reservation, reservations_offering"
)
STAMP = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
LOGS = ROOT / "var" / "bench" / STAMP


def sql(query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with connection.cursor() as cur:
        cur.execute(query, params)
        return list(cur.fetchall()) if cur.description else []


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
    return int(
        sql(
            "SELECT count(*) FROM reservations_reservation WHERE status = 'held' "
            "AND expires_at <= now()"
        )[0][0]
    )


def released_count() -> int:
    return int(sql("SELECT count(*) FROM reservations_reservation WHERE status = 'released'")[0][0])


def check(expected: int) -> list[str]:
    from cleanup.drills.invariants import invariant_violations

    problems = invariant_violations()
    if released_count() != expected:
        problems.append(f"released {released_count()} of {expected}")
    return problems


# --- measurements ----------------------------------------------------------------------------


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


SET_BASED_SQL = """
WITH rel AS (
    UPDATE reservations_reservation r
    SET status = 'released', released_version = r.version, released_at = now(),
        release_reason = 'expired', updated_at = now()
    WHERE r.status = 'held' AND r.expires_at <= now()
    RETURNING r.id, r.offering_id, r.version, r.expires_at
), rc AS (
    INSERT INTO cleanup_cleanupreceipt (idempotency_key, reservation_id, version, outcome,
        attempt, worker, task_id, trace_id, queue_age_seconds, duration_ms, created_at)
    SELECT 'release:' || id || ':' || version, id, version, 'released', 1, 'bench-set', '', '',
           NULL, NULL, now() FROM rel
    RETURNING 1
), seat AS (
    UPDATE reservations_offering o SET seats_available = o.seats_available + c.n
    FROM (SELECT offering_id, count(*) AS n FROM rel GROUP BY offering_id) c
    WHERE o.id = c.offering_id
    RETURNING 1
), ev AS (
    INSERT INTO reservations_outboxevent (kind, reservation_id, version, payload, created_at)
    SELECT 'reservation.released', id, version,
           jsonb_build_object('offering_id', offering_id, 'expires_at', expires_at,
                              'reason', 'expired'), now() FROM rel
    RETURNING 1
)
SELECT (SELECT count(*) FROM rel), (SELECT count(*) FROM rc), (SELECT count(*) FROM ev)
"""


def set_based(holds: int) -> dict[str, Any]:
    reset()
    create_holds(holds)
    t = time.perf_counter()
    with transaction.atomic():
        released, receipts, events = sql(SET_BASED_SQL)[0]
    elapsed = time.perf_counter() - t
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
    """The same conditional transaction per row (release CTE + receipt + commit), bare psycopg,
    one process."""
    import psycopg

    reset()
    create_holds(holds)
    ids = sql(
        "SELECT id, version FROM reservations_reservation WHERE status = 'held' "
        "ORDER BY id LIMIT %s",
        [rows],
    )
    receipt = (
        "INSERT INTO cleanup_cleanupreceipt (idempotency_key, reservation_id, version, "
        "outcome, attempt, worker, task_id, trace_id, queue_age_seconds, duration_ms, "
        "created_at) VALUES (%s, %s, %s, 'released', 1, 'bench-loop', '', '', NULL, "
        "NULL, now()) ON CONFLICT (idempotency_key) DO NOTHING"
    )
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        t = time.perf_counter()
        for rid, version in ids:
            with conn.transaction():
                row = conn.execute(
                    services._RELEASE_CTES + " SELECT count(*) FROM released_rows",
                    {"ids": [rid], "versions": [version], "reason": "expired", "now": None},
                ).fetchone()
                assert row is not None and row[0] == 1
                conn.execute(receipt, [f"release:{rid}:{version}", rid, version])
        elapsed = time.perf_counter() - t
    return {
        "rows": len(ids),
        "seconds": round(elapsed, 3),
        "rate": round(len(ids) / elapsed, 1),
        "violations": check(len(ids)),
    }


def start_layout(
    name: str,
    layout: tuple[int, int],
    queues: str,
    env: dict[str, str],
    extra: list[str] | None = None,
) -> list[WorkerProcess]:
    instances, concurrency = layout
    workers = [
        WorkerProcess(
            f"bench-{name}-{i}-{os.getpid()}",
            concurrency,
            LOGS / f"{name}-{i}.log",
            queues=queues,
            env=env,
            extra_args=extra or [],
        ).start()
        for i in range(instances)
    ]
    for w in workers:
        w.wait_ready()
    return workers


def stop_all(workers: list[WorkerProcess]) -> None:
    for w in workers:
        w.stop(timeout=30)


def publish_noops(n: int) -> None:
    from bench.tasks import noop
    from config.celery_app import app

    with app.producer_or_acquire() as producer:
        for i in range(n):
            noop.apply_async(args=(i,), queue="bench", producer=producer)


def wait_drained(queue: str, timeout: float) -> float:
    r = redis_client()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.llen(queue) == 0 and r.hlen("unacked") == 0:
            return time.perf_counter()
        time.sleep(0.01)
    raise TimeoutError(f"{queue} not drained in {timeout}s")


def noop_drain(n: int, layout: tuple[int, int], events: bool = False) -> dict[str, Any]:
    """Pre-fill the queue, start the workers, time from the first fetch to the last ack."""
    reset()
    publish_noops(n)
    r = redis_client()
    env = {"CELERY_TASK_EVENTS": str(events).lower()}
    workers = [
        WorkerProcess(
            f"bench-noop{i}-{os.getpid()}",
            layout[1],
            LOGS / f"noop-{i}.log",
            queues="bench",
            env=env,
            extra_args=["-I", "bench.tasks"],
        ).start()
        for i in range(layout[0])
    ]
    try:
        while r.llen("bench") >= n:
            if not all(w.alive() for w in workers):
                raise RuntimeError(workers[0].log_tail())
            time.sleep(0.002)
        t0 = time.perf_counter()
        cpu0 = cpu_times()
        t1 = wait_drained("bench", timeout=600)
        cpu = cpu_busy_since(cpu0)
    finally:
        stop_all(workers)
    return {
        "tasks": n,
        "layout": f"{layout[0]}x{layout[1]}",
        "seconds": round(t1 - t0, 3),
        "rate": round(n / (t1 - t0), 1),
        "machine_cpu_busy": cpu,
        "events": events,
    }


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy_since(start: tuple[int, int]) -> float:
    busy, total = cpu_times()
    return round((busy - start[0]) / max(1, total - start[1]), 3)


def product_drain(
    holds: int,
    layout: tuple[int, int],
    *,
    events: bool = False,
    mode: str = "single",
    shards: int = 4,
    profile_to: Path | None = None,
) -> dict[str, Any]:
    """Real sweeps through the broker, fan-out, release on real workers: holds / time from the
    first sweep to all released."""
    from cleanup.tasks import sweep_shard_task

    reset()
    create_holds(holds)
    env = {"CELERY_TASK_EVENTS": str(events).lower(), "CLEANUP_RELEASE_MODE": mode}
    name = f"{mode}-{layout[0]}x{layout[1]}-{'ev' if events else 'noev'}"
    workers = start_layout(name, layout, "", env)
    spies: list[Any] = []
    memory: dict[str, Any] = {}
    try:
        if profile_to:
            spies = profile.start([w.pid for w in workers], profile_to)
        t0 = time.perf_counter()
        cpu0 = cpu_times()
        last_sweep = 0.0
        deadline = t0 + 1800
        while True:
            now = time.perf_counter()
            if now - last_sweep >= 5:  # as beat would: one sweep per shard every 5 s
                for shard in range(shards):
                    sweep_shard_task.apply_async(kwargs={"shard": shard, "shards": shards})
                last_sweep = now
            if released_count() >= holds:
                break
            if now > deadline:
                raise TimeoutError(f"{name}: {released_count()} of {holds} released")
            time.sleep(0.1)
        t1 = time.perf_counter()
        cpu = cpu_busy_since(cpu0)
        memory = {w.name: w.memory() for w in workers}
    finally:
        profile.stop(spies)
        stop_all(workers)
    outcomes = dict(sql("SELECT outcome, count(*) FROM cleanup_cleanupreceipt GROUP BY 1"))
    return {
        "holds": holds,
        "layout": f"{layout[0]}x{layout[1]}",
        "events": events,
        "mode": mode,
        "seconds": round(t1 - t0, 3),
        "rate": round(holds / (t1 - t0), 1),
        "machine_cpu_busy": cpu,
        "outcomes": outcomes,
        "violations": check(holds),
        "memory_kb": memory,
    }


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
                        services.claim_expired(
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
                    services.claim_expired(0, 4, batch_size=batch, lease_seconds=300, max_claims=10)
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


class _Rollback(Exception):
    pass


def rss(tasks: int, layout: tuple[int, int]) -> dict[str, Any]:
    """Peak RSS of each worker process after tasks/10 and after ``tasks`` no-op tasks."""
    reset()
    r = redis_client()
    workers = start_layout("rss", layout, "bench", {}, ["-I", "bench.tasks"])
    snapshots = {}
    try:
        done = 0
        for checkpoint in (tasks // 10, tasks):
            remaining = checkpoint - done
            while remaining > 0:
                chunk = min(remaining, 5000)
                publish_noops(chunk)
                remaining -= chunk
                while r.llen("bench") > 5000:
                    time.sleep(0.05)
            wait_drained("bench", timeout=1200)
            done = checkpoint
            snapshots[str(checkpoint)] = {w.name: w.memory() for w in workers}
    finally:
        stop_all(workers)

    def peak(snapshot: dict[str, Any], kind: str) -> int:
        return max(
            v.get("VmHWM", 0)
            for procs in snapshot.values()
            for k, v in procs.items()
            if (k == "main") == (kind == "main")
        )

    first, last = snapshots[str(tasks // 10)], snapshots[str(tasks)]
    growth = {
        kind: round(peak(last, kind) / peak(first, kind) - 1, 4) for kind in ("main", "child")
    }
    return {
        "tasks": tasks,
        "layout": f"{layout[0]}x{layout[1]}",
        "snapshots_kb": snapshots,
        "growth": growth,
        "max_growth": max(growth.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--holds", type=int, default=20000)
    parser.add_argument(
        "--drain-holds",
        type=int,
        default=0,
        help="holds/tasks for the worker drains (default: --holds); lower it "
        "when the machine is too slow to drain 20k several times",
    )
    parser.add_argument(
        "--loop-rows",
        type=int,
        default=3000,
        help="rows for the single-process psycopg loop (commit-bound)",
    )
    parser.add_argument("--rss-tasks", type=int, default=100000)
    parser.add_argument("--sweep-rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=2, help="best of N for the drains")
    parser.add_argument(
        "--skip", default="", help="comma list: rss,sweep,events,layouts,batch,drains"
    )
    parser.add_argument(
        "--profile",
        choices=("single", "batch"),
        help="only profile one drain (1x2) of this release mode with py-spy, and print where "
        "the pool processes' time went",
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    drain = args.drain_holds or args.holds
    RESULTS.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "started": STAMP,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "note": "2 cores, shared with other people's test runs",
        },
        "holds": args.holds,
        "drain_holds": drain,
        "argv": sys.argv[1:],
        "broker": os.environ["CELERY_BROKER_URL"],
        "database": BENCH_DB,
    }

    def best(fn: Any, *a: Any, **kw: Any) -> dict[str, Any]:
        runs = [fn(*a, **kw) for _ in range(args.repeat)]
        top = max(runs, key=lambda x: x["rate"])
        top["runs"] = [x["rate"] for x in runs]
        return top

    path = RESULTS / f"{STAMP}.json"
    if args.profile:
        return profile_drain(args.profile, drain, path)

    def step(name: str) -> None:
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")  # partial results
        print(f"[{time.strftime('%H:%M:%S')}] {name} …", flush=True)

    step("commit latency")
    res["commit_latency"] = commit_latency()
    step("set-based CTE")
    res["set_based"] = best(set_based, args.holds)
    step("psycopg loop")
    res["psycopg_loop"] = psycopg_loop(args.holds, args.loop_rows)
    layouts = [(1, 2)] if "layouts" in skip else [(1, 2), (2, 1)]
    if "drains" in skip:
        layouts = []
    res["noop"] = {}
    res["per_reservation"] = {}
    for lay in layouts:
        key = f"{lay[0]}x{lay[1]}"
        step(f"no-op drain {key}")
        res["noop"][key] = best(noop_drain, drain, lay)
        step(f"per-reservation drain {key}")
        res["per_reservation"][key] = best(product_drain, drain, lay)
    best_layout = max(
        res["per_reservation"], key=lambda k: res["per_reservation"][k]["rate"], default="1x2"
    )
    lay_t = tuple(int(x) for x in best_layout.split("x"))
    if "events" not in skip and "drains" not in skip:
        step(f"per-reservation drain {best_layout}, task events on")
        res["per_reservation_events"] = product_drain(drain, lay_t, events=True)  # type: ignore[arg-type]
    if "batch" not in skip and "drains" not in skip:
        step(f"batched drain {best_layout}")
        res["batched"] = best(product_drain, drain, lay_t, mode="batch")
    else:
        skipped = skip & {"batch", "drains"}
        res["batched"] = {"skipped": f"--skip {','.join(sorted(skipped))}"}
    if "sweep" not in skip:
        step("sweep cost 20k vs 1M rows")
        res["sweep"] = sweep_cost(args.holds, args.sweep_rows, 2000, 500)
    if "rss" not in skip:
        step(f"RSS after {args.rss_tasks // 10} and {args.rss_tasks} tasks")
        res["rss"] = rss(args.rss_tasks, (1, 2))
    reset()
    res["ratios"] = ratios(res, best_layout)
    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print_table(res, best_layout)
    print(f"\nwritten {path.relative_to(ROOT)}")
    return 0


def profile_drain(mode: str, holds: int, path: Path) -> int:
    """One 1x2 drain of ``mode`` under py-spy (raw stacks in bench/results/<stamp>-profile-*)."""
    folder = RESULTS / f"{STAMP}-profile-{mode}"
    drain = product_drain(holds, (1, 2), mode=mode, profile_to=folder)
    summary = profile.summarize(folder, [int(p.stem.split("-")[1]) for p in folder.glob("*.txt")])
    path.write_text(json.dumps({"drain": drain, "profile": summary}, indent=2) + "\n")
    print(
        f"\n{mode} drain 1x2, {holds} holds: {drain['rate']:,.0f} holds/s under py-spy, "
        f"machine CPU busy {drain['machine_cpu_busy']:.0%}"
    )
    profile.print_summary(summary)
    print(f"\nwritten {path.relative_to(ROOT)} and {folder.relative_to(ROOT)}/")
    return 0


def ratios(res: dict[str, Any], layout: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, pr in res["per_reservation"].items():
        out[f"per_reservation_vs_noop_{key}"] = {
            "value": round(pr["rate"] / res["noop"][key]["rate"], 3),
            "target": ">= 0.75",
        }
    if "rate" in res.get("batched", {}):
        out["batched_vs_set_based"] = {
            "value": round(res["batched"]["rate"] / res["set_based"]["rate"], 4),
            "target": ">= 0.3",
        }
    if "sweep" in res:
        out["sweep_1m_vs_20k"] = {"value": res["sweep"]["ratio"], "target": "<= 1.5"}
    if "rss" in res:
        out["rss_growth_10k_to_100k"] = {"value": res["rss"]["max_growth"], "target": "<= 0.10"}
    if "per_reservation_events" in res:
        out["events_on_vs_off"] = {
            "value": round(
                res["per_reservation_events"]["rate"] / res["per_reservation"][layout]["rate"], 3
            ),
            "target": "(cost)",
        }
    out["psycopg_loop_vs_set_based"] = {
        "value": round(res["psycopg_loop"]["rate"] / res["set_based"]["rate"], 4),
        "target": "-",
    }
    return out


def _per_second(measured: dict[str, Any], unit: str) -> str:
    return f"{measured['rate']:,.0f} {unit}/s" if "rate" in measured else "-"


def print_table(res: dict[str, Any], layout: str) -> None:
    """One row per measurement: (what, result, note)."""
    cl, sb, pl = res["commit_latency"], res["set_based"], res["psycopg_loop"]
    rows: list[tuple[str, str, str]] = [
        ("commit latency (300 autocommit inserts)", f"{cl['mean_ms']} ms", f"{cl['tps']} tps"),
        (f"set-based CTE, {sb['holds']} holds", _per_second(sb, "rows"), f"{sb['seconds']} s"),
        (f"psycopg per-row loop, {pl['rows']} rows", _per_second(pl, "rows"), f"{pl['seconds']} s"),
    ]
    drains = (
        ("noop", "Celery no-op drain", "tasks"),
        ("per_reservation", "per-reservation", "holds"),
    )
    for kind, label, unit in drains:
        for key, d in res[kind].items():
            rows.append(
                (f"{label} {key}, {d[unit]} {unit}", _per_second(d, unit), f"runs {d['runs']}")
            )
    if "per_reservation_events" in res:
        ev = res["per_reservation_events"]
        events = f"per-reservation {layout}, task events ON"
        rows.append((events, _per_second(ev, "holds"), f"{ev['seconds']} s"))
    b = res["batched"]
    skipped = "" if "rate" in b else "SKIPPED: " + b["skipped"]
    rows.append(
        (f"batched mode {layout}, {b.get('holds', '-')} holds", _per_second(b, "holds"), skipped)
    )
    for table in ("small", "large") if "sweep" in res else ():
        claim = res["sweep"][table]
        rows.append(
            (f"sweep claim 500 @ {claim['rows']:,} rows", f"{claim['median_ms']} ms", "median of 7")
        )
    if "rss" in res:
        r, growth = res["rss"], res["rss"]["growth"]
        name = f"worker RSS growth {r['tasks'] // 10}→{r['tasks']} no-op tasks"
        rows.append((name, f"main {growth['main']:+.1%}", f"child {growth['child']:+.1%}"))
    width = max(len(r[0]) for r in rows) + 2
    print("\n" + "measurement".ljust(width) + "result".ljust(20) + "note")
    for name, value, note in rows:
        print(name.ljust(width) + value.ljust(20) + note)
    print("\nratio".ljust(width) + "value".ljust(20) + "target")
    for name, r in res["ratios"].items():
        print(name.ljust(width) + str(r["value"]).ljust(20) + r["target"])


if __name__ == "__main__":
    raise SystemExit(main())
