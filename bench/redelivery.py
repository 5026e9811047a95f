"""What a prefetch above one costs when a worker is lost, and what the broker sees per hold.

``killed_worker``: a worker draining no-op tasks under the product's delivery contract
(acks_late, the prefetch of the variant) is SIGKILLed with its pool; every message it had
fetched and not acknowledged (the ones running and the ones prefetched) stays in kombu's
``unacked`` hash until the visibility timeout has passed, then a second worker's restore scan
puts it back. Measured: how many messages were stranded, and when the last came back.

``broker_commands``: Redis ``MONITOR`` during a small per-reservation drain, the commands on the
bench's database counted by name, per hold (commands, not round trips: kombu pipelines the
unacked bookkeeping, ZADD+HSET on delivery and ZREM+HDEL on ack, and the sweep pipelines its
LPUSHes).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any

from bench.arms import events, settings_env
from bench.database import reset, sql
from bench.drains import DEFAULT, Variant, product_drain, publish_noops, wait_drained
from bench.paths import LOGS
from cleanup.broker.readers import redis_client
from tools.drills.workers import WorkerProcess

# A short visibility timeout so the measurement takes seconds (the product's default is 75 s;
# the settings require it above the task time limit plus the retry backoff, hence these).
SHORT_VISIBILITY = {
    "CLEANUP_VISIBILITY_TIMEOUT": "15",
    "CLEANUP_TASK_TIME_LIMIT": "10",
    "CLEANUP_TASK_SOFT_TIME_LIMIT": "8",
    "CLEANUP_RETRY_BACKOFF_MAX": "2",
}
# ... and the scan for messages past it every second (a Django setting, not a variable).
SHORT_RESTORE = {"CLEANUP_UNACKED_RESTORE_INTERVAL": 1}


def _noop_worker(label: str, concurrency: int, variant: Variant) -> WorkerProcess:
    chosen = events(False) | SHORT_RESTORE | variant.settings
    return WorkerProcess(
        f"bench-{label}-{os.getpid()}",
        concurrency,
        LOGS / f"{label}.log",
        queues="bench",
        env={**settings_env(chosen), **SHORT_VISIBILITY, **variant.env},
        extra_args=["-I", "bench.tasks"],
    ).start()


def killed_worker(
    variant: Variant, tasks: int = 2000, concurrency: int = 2, wait_ms: float = 3.0
) -> dict[str, Any]:
    """Tasks of ``wait_ms`` (about a release's database wait), so the pool processes are busy
    and the worker holds as many messages as its prefetch allows when it is killed."""
    reset()
    limits = (
        int(SHORT_VISIBILITY["CLEANUP_TASK_TIME_LIMIT"]),
        int(SHORT_VISIBILITY["CLEANUP_TASK_SOFT_TIME_LIMIT"]),
    )
    publish_noops(tasks, wait_ms, limits)
    r = redis_client()
    slug = "".join(c if c.isalnum() else "-" for c in variant.name)[:24]
    first = _noop_worker(f"kill-{slug}", concurrency, variant)
    try:
        while r.llen("bench") > tasks * 0.8:  # let it reach full speed
            if not first.alive():
                raise RuntimeError(first.log_tail())
            time.sleep(0.005)
    finally:
        first.kill()
    killed = time.perf_counter()
    stranded = int(r.hlen("unacked"))
    second = _noop_worker(f"rescue-{slug}", concurrency, DEFAULT)
    try:
        second.wait_ready()
        waiting_emptied = None
        while r.hlen("unacked") or r.llen("bench"):
            if waiting_emptied is None and not r.llen("bench"):
                waiting_emptied = time.perf_counter()
            time.sleep(0.05)
        done = wait_drained("bench", 120)
    finally:
        second.stop()
    return {
        "variant": variant.name,
        "concurrency": concurrency,
        "visibility_timeout_s": int(SHORT_VISIBILITY["CLEANUP_VISIBILITY_TIMEOUT"]),
        "task_ms": wait_ms,
        "stranded_messages": stranded,
        "queue_drained_after_s": None
        if waiting_emptied is None
        else round(waiting_emptied - killed, 2),
        "last_redelivered_after_s": round(done - killed, 2),
        "dead_letters": int(sql("SELECT count(*) FROM cleanup_deadletter")[0][0]),
    }


def broker_commands(holds: int = 500) -> dict[str, Any]:
    """Redis commands on the bench's database per hold over a per-reservation drain (1 × 2)."""
    db = redis_client().connection_pool.connection_kwargs.get("db", 0)
    counts: Counter[str] = Counter()
    stop = threading.Event()
    monitor_client = redis_client().__class__(
        **{
            k: v
            for k, v in redis_client().connection_pool.connection_kwargs.items()
            if k in ("host", "port", "db", "password", "username")
        }
    )

    def watch() -> None:
        with monitor_client.monitor() as monitor:
            while not stop.is_set():
                try:
                    command = monitor.next_command()
                except Exception:  # noqa: BLE001 - the connection closes when we stop
                    return
                if int(command.get("db", -1)) == db:
                    counts[str(command["command"]).split(" ", 1)[0].upper()] += 1

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        drain = product_drain(holds, (1, 2), variant=DEFAULT)
    finally:
        stop.set()
        monitor_client.close()
        thread.join(5)
    return {
        "holds": holds,
        "rate_under_monitor": drain["rate"],
        "database_per_hold": drain["database_per_hold"],
        "redis_commands_per_hold": {k: round(v / holds, 2) for k, v in counts.most_common()},
        "redis_commands_per_hold_total": round(sum(counts.values()) / holds, 2),
    }
