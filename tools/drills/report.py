"""The burst drill's outputs: report.json, a Markdown summary and a PNG plot, from a report the
drive loop built (``tools.drills.burst``).

The plot needs matplotlib, which is a dev requirement only (requirements-dev.in), not a runtime
one: with numpy, Pillow and fonttools it would add tens of megabytes of native code to the image
that runs web, workers and beat, for one chart of a drill run now and then. Without it the drill
still writes report.json (every sample) and report.md, and says in both, and in the command's
output, why there is no plot.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.drills.state import BurstConfig, BurstState

NO_MATPLOTLIB = (
    "plot.png not written: matplotlib is not installed here (it is a dev requirement, not a "
    "runtime one). Every sample is in report.json; for the plot, run the drill where "
    "requirements-dev.txt is installed."
)


def write_outputs(cfg: BurstConfig, report: dict[str, Any], state: BurstState) -> None:
    """Write plot.png (when matplotlib is there), report.json and report.md; ``report["plot"]``
    says whether the plot was written and, if not, why."""
    path = cfg.out / "plot.png"
    missing = plot(cfg, report, state, path)
    report["plot"] = {"written": missing is None, "path": str(path), "note": missing}
    (cfg.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (cfg.out / "report.md").write_text(markdown(cfg, report))


def plot(cfg: BurstConfig, report: dict[str, Any], state: BurstState, path: Path) -> str | None:
    """Draw the plot into ``path``; None when written, else why not (matplotlib missing)."""
    try:
        import matplotlib  # noqa: PLC0415 - heavy and optional: only for the plot
    except ImportError:
        return NO_MATPLOTLIB
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use('Agg')

    ts = [s.t for s in state.samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    shards = sorted({k for s in state.samples for k in s.oldest_by_shard}, key=int)
    for k in shards:
        ax1.plot(
            ts,
            [s.oldest_by_shard.get(k, 0.0) for s in state.samples],
            lw=0.8,
            alpha=0.6,
            label=f"shard {k}",
        )
    ax1.plot(
        ts,
        [s.oldest_eligible_s or 0.0 for s in state.samples],
        color="black",
        lw=2,
        label="oldest eligible (max)",
    )
    ax1.axhline(cfg.slo, color="red", ls="--", label=f"SLO {cfg.slo:g} s")
    ax1.set_ylabel("oldest eligible hold age (s)")
    ax1.legend(loc="upper left", fontsize=8, ncol=3)
    ax1.grid(alpha=0.3)
    ax2.plot(ts, [s.eligible for s in state.samples], label="eligible holds (backlog)", lw=2)
    ax2.plot(ts, [s.queue_depth for s in state.samples], label="release queue depth", lw=1.5)
    ax2.plot(ts, [s.released for s in state.samples], label="released (cumulative)", lw=1, ls=":")
    ax2.set_ylabel("holds / messages")
    ax2.set_xlabel("seconds since the holds were created")
    ax2.grid(alpha=0.3)
    for ev in state.events:
        if "drain" in ev["event"] or "kill" in ev["event"]:
            color = "orange" if "drain" in ev["event"] else "purple"
            for ax in (ax1, ax2):
                ax.axvline(ev["t"], color=color, ls="-.")
            ax1.text(
                ev["t"],
                0.97,
                " ".join(ev["event"].split(" ")[:2]),
                color=color,
                fontsize=8,
                rotation=90,
                ha="right",
                va="top",
                transform=ax1.get_xaxis_transform(),
            )
    ax2.legend(loc="upper right", fontsize=8)
    ok = "invariants OK" if report["invariants"]["ok"] else "INVARIANTS FAILED"
    fig.suptitle(
        f"Burst: {report['holds']:,} holds over {cfg.window:g} s, "
        f"{cfg.workers or '?'} workers × {cfg.concurrency}, "
        f"mode {report.get('release_mode', '?')} — {ok}\n"
        f"measured on this drill's own holds only (#{report['first_id']:,}–#{report['last_id']:,})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def markdown(cfg: BurstConfig, report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        f"# Burst drill — {report['holds']:,} holds over {cfg.window:g} s",
        "",
        f"- release mode: {report.get('release_mode', '?')}; measured on this drill's own holds "
        f"only (#{report['first_id']:,}–#{report['last_id']:,})",
        f"- workers: {cfg.workers or 'an already running fleet'} × concurrency {cfg.concurrency}; "
        f"shards {cfg.shards}; sweeps every {cfg.sweep_every:g} s "
        f"({'sent by the drill' if cfg.send_sweeps else 'beat'})",
        f"- finished: **{report['finished']}** in {report['elapsed_s']} s",
        f"- peak oldest eligible age: **{s['peak_oldest_eligible_s']} s** (SLO {s['slo_s']:g} s; "
        f"{s['seconds_above_slo']} samples above)",
        f"- peak backlog: {s['peak_eligible']:,} eligible; peak queue depth "
        f"{s['peak_queue_depth']:,}",
        f"- released {s['released']:,}; renewed {report['renewed']} (missed "
        f"{report['renew_missed']}); delivered twice: {report.get('duplicate_messages', 0):,} "
        f"messages carrying {report['duplicates_published']:,} holds",
        f"- outcomes (receipts): {json.dumps(s['outcomes'])} — a duplicate of a handled key "
        f"ends already_handled without a second receipt (the key is unique), so duplicates "
        f"show as release attempts beyond transitions",
        f"- release attempts (one per hold, batched or not) {s['attempts']:,} for "
        f"{s['outcomes'].get('released', 0):,} transitions; redeliveries {s['redeliveries']:,}; "
        f"retries {s['retries']}; dead letters {s['dead_letters']}",
        f"- release messages {s.get('messages', 0):,} for {s['receipts']:,} receipts; "
        f"{s.get('single_hold_messages', 0):,} carried one hold "
        f"(share {s.get('single_hold_message_share')}); each shard's backlog last seen at "
        f"{s.get('shard_backlog_last_seen_s', {})} s",
        f"- processing rate {s['processing_rate_per_s']} receipts/s over "
        f"{s['processing_window_s']} s; "
        f"release transaction mean {s['release_db_ms_mean']} ms",
        *(
            [
                f"- set-based release statement (same database, after the drain): "
                f"{report['set_based']['rows_per_s']:,} rows/s over "
                f"{report['set_based']['holds']:,} holds; the drain's processing rate is "
                f"**{report['drain_vs_set_based']}** of it"
            ]
            if report.get("set_based")
            else []
        ),
        f"- release lateness (released_at − expires_at): p50 {s['release_lateness_p50_s']} s, "
        f"p99 {s['release_lateness_p99_s']} s, max {s['release_lateness_max_s']} s",
        f"- measured service time per consumer: {report['capacity_inputs']['service_time_s']} s "
        f"(`manage.py capacity_plan --from-report report.json`)",
        "",
        "## Events",
        *[f"- t={e['t']} s: {e['event']}" for e in report["events"]],
        "",
        "## Invariants",
        "- all OK"
        if report["invariants"]["ok"]
        else "\n".join(f"- FAILED: {v}" for v in report["invariants"]["violations"]),
        "",
        "![plot](plot.png)"
        if report.get("plot", {}).get("written", True)
        else f"_{report['plot']['note']}_",
        "",
    ]
    return "\n".join(lines)
