"""Drains by real ``celery worker`` processes on the bench's Redis DB: no-op tasks (Celery's
floor), the per-reservation and batched release paths, and worker memory over many tasks."""

from __future__ import annotations

import importlib.util
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import profile
from bench.arms import events as events_on
from bench.arms import settings_env
from bench.database import any_held, check, create_holds, released_count, reset, sql
from bench.paths import LOGS
from cleanup.broker.readers import redis_client
from tools.drills.otlp_receiver import Receiver
from tools.drills.workers import WorkerProcess


@dataclass(frozen=True)
class Variant:
    """A worker configuration measured side by side with the product's default: environment
    variables, Django settings (bench/arms.py) and ``celery worker`` arguments added to the
    drain's own."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    settings: dict[str, object] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    requires: str = ""  # a module that must be importable, else the variant is skipped

    def available(self) -> bool:
        return not self.requires or importlib.util.find_spec(self.requires) is not None


DEFAULT = Variant("prefork, prefetch 1 (default)")
# The per-reservation hot path's candidates: a prefetch that hides the broker round trip between two
# tasks, and pools whose workers wait on I/O without a process each.
VARIANTS = (
    DEFAULT,
    Variant("prefork, prefetch 2", {"CELERY_WORKER_PREFETCH_MULTIPLIER": "2"}),
    Variant("prefork, prefetch 4", {"CELERY_WORKER_PREFETCH_MULTIPLIER": "4"}),
    # Measured only: a cleanup worker refuses these pools unless CLEANUP_WORKER_POOLS allows them.
    Variant(
        "threads pool", settings={"CLEANUP_WORKER_POOLS": ["threads"]}, args=("--pool", "threads")
    ),
    Variant(
        "gevent pool",
        settings={"CLEANUP_WORKER_POOLS": ["gevent"]},
        args=("--pool", "gevent"),
        requires="gevent",
    ),
)


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


def publish_noops(n: int, wait_ms: float = 0, limits: tuple[int, int] | None = None) -> None:
    """``n`` no-op tasks on the "bench" queue (``bench.wait`` tasks of ``wait_ms`` if given).
    ``limits``: the (hard, soft) time limits to ask for, when the worker runs with lower ones
    than this process's settings (its screening refuses a message asking for more)."""
    from bench.tasks import noop, wait
    from config.celery_app import app

    options: dict[str, Any] = (
        {} if limits is None else {"time_limit": limits[0], "soft_time_limit": limits[1]}
    )
    with app.producer_or_acquire() as producer:
        for i in range(n):
            if wait_ms:
                wait.apply_async(args=(wait_ms,), queue="bench", producer=producer, **options)
            else:
                noop.apply_async(args=(i,), queue="bench", producer=producer, **options)


def wait_drained(queue: str, timeout: float) -> float:
    r = redis_client()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.llen(queue) == 0 and r.hlen("unacked") == 0:
            return time.perf_counter()
        time.sleep(0.01)
    raise TimeoutError(f"{queue} not drained in {timeout}s")


def noop_drain(
    n: int,
    layout: tuple[int, int],
    events: bool = False,
    variant: Variant = DEFAULT,
    wait_ms: float = 0,
) -> dict[str, Any]:
    """Pre-fill the queue, start the workers, time from the first fetch to the last ack.
    ``wait_ms``: ``bench.wait`` tasks that sleep that long instead of no-ops (a task as long as
    a release, with none of its work)."""
    reset()
    publish_noops(n, wait_ms)
    r = redis_client()
    env = {**settings_env(events_on(events) | variant.settings), **variant.env}
    workers = [
        WorkerProcess(
            f"bench-noop{i}-{os.getpid()}",
            layout[1],
            LOGS / f"noop-{i}.log",
            queues="bench",
            env=env,
            extra_args=["-I", "bench.tasks", *variant.args],
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
        "variant": variant.name,
        "wait_ms": wait_ms,
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
    variant: Variant = DEFAULT,
) -> dict[str, Any]:
    """Real sweeps through the broker, fan-out, release on real workers: holds / time from the
    first sweep to all released. Also the database's row updates (and how many of them were
    HOT: no index entry written) and transactions per hold over the drain."""
    from cleanup.tasks import sweep_shard_task

    reset()
    create_holds(holds)
    chosen = events_on(events) | {"CLEANUP_RELEASE_MODE": mode} | variant.settings
    env = {**settings_env(chosen), **variant.env}
    slug = "".join(c if c.isalnum() else "-" for c in variant.name)[:24]
    name = f"{mode}-{layout[0]}x{layout[1]}-{'ev' if events else 'noev'}-{slug}"
    workers = start_layout(name, layout, "", env, list(variant.args))
    stats0 = database_stats()
    spies: list[Any] = []
    memory: dict[str, Any] = {}
    try:
        if profile_to:
            spies = profile.start([w.pid for w in workers], profile_to)
        t0 = time.perf_counter()
        cpu0 = cpu_times()
        last_sweep = 0.0
        deadline = t0 + 1800
        polls = 0
        while True:
            now = time.perf_counter()
            if now - last_sweep >= 5:  # as beat would: one sweep per shard every 5 s
                for shard in range(shards):
                    sweep_shard_task.apply_async(kwargs={"shard": shard, "shards": shards})
                last_sweep = now
            polls += 1
            if not any_held():  # every hold of the drain is due: all released (check() counts)
                break
            if now > deadline:
                raise TimeoutError(f"{name}: {released_count()} of {holds} released")
            time.sleep(0.02)
        t1 = time.perf_counter()
        cpu = cpu_busy_since(cpu0)
        memory = {w.name: w.memory() for w in workers}
    finally:
        profile.stop(spies)
        stop_all(workers)
    stats1 = database_stats()
    stats1["transactions"] -= polls  # the bench's own reads of the released count
    work = per_hold(stats0, stats1, holds)
    outcomes = dict(sql("SELECT outcome, count(*) FROM cleanup_cleanupreceipt GROUP BY 1"))
    release_ms = release_attempt_ms([w.log_path for w in workers])
    return {
        "holds": holds,
        "layout": f"{layout[0]}x{layout[1]}",
        "events": events,
        "mode": mode,
        "seconds": round(t1 - t0, 3),
        "rate": round(holds / (t1 - t0), 1),
        "machine_cpu_busy": cpu,
        "outcomes": outcomes,
        # a release attempt's time inside the worker, validation to commit (its log lines)
        "release_ms_median": release_ms,
        "violations": check(holds),
        "memory_kb": memory,
        "variant": variant.name,
        "database_per_hold": work,
    }


RELEASE_ATTEMPT_MS = re.compile(r" release attempt .* duration_ms=([0-9.]+) ")


def release_attempt_ms(logs: list[Path]) -> float | None:
    """The median ``duration_ms`` of the workers' "release attempt" log lines: a release's own
    time inside the worker, from its validation to the statement's commit."""
    found: list[float] = []
    for log in logs:
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        found += [float(m) for m in RELEASE_ATTEMPT_MS.findall(text)]
    return round(statistics.median(found), 3) if found else None


def tracing_cost(
    per_reservation_holds: int, batch_holds: int, layout: tuple[int, int], repeat: int
) -> dict[str, Any]:
    """The per-reservation and batched drains with tracing off and on (every worker exporting
    its spans over OTLP/HTTP to a receiver in this process, as to a collector), taking turns
    so that a drift of the machine touches both alike; best of ``repeat`` each. With tracing on,
    also the spans the receiver got per hold."""
    out: dict[str, Any] = {}
    with Receiver() as receiver:
        traced = Variant("traced", env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
        for mode, holds in (("single", per_reservation_holds), ("batch", batch_holds)):
            runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
            spans_before = len(receiver.spans)
            for _ in range(repeat):
                runs["off"].append(product_drain(holds, layout, mode=mode))
                runs["on"].append(product_drain(holds, layout, mode=mode, variant=traced))
            spans = len(receiver.spans) - spans_before
            best = {arm: max(r, key=lambda x: x["rate"]) for arm, r in runs.items()}
            out[mode] = {
                "holds": holds,
                "off": best["off"]["rate"],
                "on": best["on"]["rate"],
                "runs": {arm: [x["rate"] for x in r] for arm, r in runs.items()},
                "on_vs_off": round(best["on"]["rate"] / best["off"]["rate"], 3),
                "spans_per_hold": round(spans / (holds * repeat), 2),
                "violations": [v for r in runs.values() for x in r for v in x["violations"]],
            }
        out["exports"] = receiver.exports
        out["exported_mib"] = round(receiver.bytes / 2**20, 1)
    return out


def database_stats() -> dict[str, int]:
    """Cumulative counters of the bench database: transactions, and row updates of the holds
    table (all, and HOT ones). PostgreSQL publishes a backend's counts when its transaction
    ends, at most once a second, and when it exits: read after the workers have stopped."""
    time.sleep(1.1)
    sql("SELECT pg_stat_clear_snapshot()")
    ((xacts,),) = sql(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database "
        "WHERE datname = current_database()"
    )
    ((updates, hot),) = sql(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
        "WHERE relname = 'reservations_reservation'"
    )
    return {"transactions": int(xacts), "hold_row_updates": int(updates), "hot_updates": int(hot)}


def per_hold(before: dict[str, int], after: dict[str, int], holds: int) -> dict[str, float]:
    return {k: round((after[k] - before[k]) / holds, 2) for k in before}


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
