"""One bench run, in order, behind ``bench/run.py`` (which prepares the database and Django
first): ``bench.database`` (measurements with no worker), ``bench.drains`` (real workers),
``bench.report`` (ratios and the table), ``bench.profile`` (py-spy, with ``--profile``).

Private database ``reservations_bench`` and private Redis DB 5 (only that DB is ever flushed).
Prints a table with ratios; writes reports/bench/<timestamp>.json and the sweep's EXPLAIN
output next to it. Performance targets live here, never in unit tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench import profile
from bench.database import BENCH_DB, commit_latency, psycopg_loop, reset, set_based, sweep_cost
from bench.drains import VARIANTS, noop_drain, product_drain, rss, tracing_cost
from bench.paths import LOGS, RESULTS, ROOT, STAMP
from bench.redelivery import broker_commands, killed_worker
from bench.report import print_table, ratios


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
        "--skip",
        default="",
        help="comma list: rss,sweep,events,tracing,layouts,batch,drains,variants,redelivery,broker",
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
        # The ceiling of any per-reservation path under this worker model: tasks that take as
        # long as a release did inside the worker, and do nothing.
        release_ms = res["per_reservation"][key].get("release_ms_median")
        if release_ms:
            step(f"release-long wait drain {key} ({release_ms} ms tasks)")
            res.setdefault("release_wait", {})[key] = best(
                noop_drain, drain, lay, wait_ms=release_ms
            )
    if "variants" not in skip and "drains" not in skip:
        # Side by side with the default 1 x 2 above: the same drains under each candidate.
        res["variants"] = {}
        for variant in VARIANTS[1:]:
            if not variant.available():
                res["variants"][variant.name] = {"skipped": f"{variant.requires} not installed"}
                continue
            step(f"variant {variant.name}: no-op and per-reservation drains 1x2")
            res["variants"][variant.name] = {
                "noop": best(noop_drain, drain, (1, 2), variant=variant),
                "per_reservation": best(product_drain, drain, (1, 2), variant=variant),
            }
    if "redelivery" not in skip:
        res["redelivery"] = {}
        for variant in VARIANTS[:3]:  # prefetch 1, 2, 4
            step(f"worker killed under {variant.name}")
            res["redelivery"][variant.name] = killed_worker(variant)
    if "broker" not in skip:
        step("Redis commands and database work per hold (MONITOR, 500 holds)")
        res["broker_commands"] = broker_commands()
    best_layout = max(
        res["per_reservation"], key=lambda k: res["per_reservation"][k]["rate"], default="1x2"
    )
    lay_t = tuple(int(x) for x in best_layout.split("x"))
    if "events" not in skip and "drains" not in skip:
        step(f"per-reservation drain {best_layout}, task events on")
        res["per_reservation_events"] = product_drain(drain, lay_t, events=True)  # type: ignore[arg-type]
    if "tracing" not in skip and "drains" not in skip:
        step(f"per-reservation and batched drains {best_layout}, tracing off and on")
        res["tracing"] = tracing_cost(drain, args.holds, lay_t, args.repeat)  # type: ignore[arg-type]
    if "batch" not in skip and "drains" not in skip:
        # As many holds as the set-based CTE it is compared with (--holds, not --drain-holds):
        # a batched drain of 5,000 lasts well under a second, too short to time.
        step(f"batched drain {best_layout}, {args.holds} holds")
        res["batched"] = best(product_drain, args.holds, lay_t, mode="batch")
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
    """One 1x2 drain of ``mode`` under py-spy (raw stacks in reports/bench/<stamp>-profile-*)."""
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
