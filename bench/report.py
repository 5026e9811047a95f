"""The ratios the performance targets are stated in, and the printed table."""

from __future__ import annotations

from typing import Any


def ratios(res: dict[str, Any], layout: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, pr in res["per_reservation"].items():
        out[f"per_reservation_vs_noop_{key}"] = {
            "value": round(pr["rate"] / res["noop"][key]["rate"], 3),
            "target": ">= 0.75",
        }
    for key, waited in res.get("release_wait", {}).items():
        out[f"release_wait_vs_noop_{key}"] = {
            "value": round(waited["rate"] / res["noop"][key]["rate"], 3),
            "target": "(the ceiling: tasks as long as a release, doing nothing)",
        }
        out[f"per_reservation_vs_release_wait_{key}"] = {
            "value": round(res["per_reservation"][key]["rate"] / waited["rate"], 3),
            "target": "(the path against its ceiling)",
        }
    floor = res["noop"].get("1x2", {}).get("rate")
    for name, v in res.get("variants", {}).items():
        if "per_reservation" not in v or not floor:
            continue
        out[f"per_reservation_vs_noop_1x2[{name}]"] = {
            "value": round(v["per_reservation"]["rate"] / floor, 3),
            "target": ">= 0.75 (default no-op)",
        }
        out[f"per_reservation_vs_own_noop_1x2[{name}]"] = {
            "value": round(v["per_reservation"]["rate"] / v["noop"]["rate"], 3),
            "target": "(same variant's no-op)",
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
    for mode, name in (("single", "per_reservation"), ("batch", "batched")):
        if mode in res.get("tracing", {}):
            out[f"{name}_traced_vs_untraced"] = {
                "value": res["tracing"][mode]["on_vs_off"],
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
    for key, d in res.get("release_wait", {}).items():
        rows.append(
            (
                f"{d['wait_ms']} ms wait tasks {key}, {d['tasks']} tasks",
                _per_second(d, "tasks"),
                f"runs {d['runs']}",
            )
        )
    for name, v in res.get("variants", {}).items():
        if "skipped" in v:
            rows.append((f"variant {name}", "-", "SKIPPED: " + v["skipped"]))
            continue
        kinds = (("noop", "no-op", "tasks"), ("per_reservation", "per-res", "holds"))
        for kind, label, unit in kinds:
            d = v[kind]
            rows.append((f"{label} 1x2, {name}", _per_second(d, unit), f"runs {d['runs']}"))
    for name, k in res.get("redelivery", {}).items():
        rows.append(
            (
                f"worker SIGKILLed, {name}",
                f"{k['stranded_messages']} stranded",
                f"last back after {k['last_redelivered_after_s']} s "
                f"(visibility {k['visibility_timeout_s']} s)",
            )
        )
    if "broker_commands" in res:
        b = res["broker_commands"]
        top = ", ".join(f"{c} {n}" for c, n in list(b["redis_commands_per_hold"].items())[:8])
        total = str(b["redis_commands_per_hold_total"])
        rows.append(("Redis commands per hold (db 5)", total, top))
        rows.append(("database work per hold", "", str(b["database_per_hold"])))
    if "per_reservation_events" in res:
        ev = res["per_reservation_events"]
        events = f"per-reservation {layout}, task events ON"
        rows.append((events, _per_second(ev, "holds"), f"{ev['seconds']} s"))
    for mode, name in (("single", "per-reservation"), ("batch", "batched")):
        t = res.get("tracing", {}).get(mode)
        if t:
            rows.append(
                (
                    f"{name} {layout}, {t['holds']} holds, tracing off / on",
                    f"{t['off']:,.0f} / {t['on']:,.0f} holds/s",
                    f"× {t['on_vs_off']}, {t['spans_per_hold']} spans per hold",
                )
            )
    b = res["batched"]
    skipped = str(b.get("database_per_hold", "")) if "rate" in b else "SKIPPED: " + b["skipped"]
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
    width = max(len(r[0]) for r in rows + [(k, "", "") for k in res["ratios"]]) + 2
    print("\n" + "measurement".ljust(width) + "result".ljust(20) + "note")
    for name, value, note in rows:
        print(name.ljust(width) + value.ljust(20) + note)
    print("\nratio".ljust(width) + "value".ljust(20) + "target")
    for name, r in res["ratios"].items():
        print(name.ljust(width) + str(r["value"]).ljust(20) + r["target"])
