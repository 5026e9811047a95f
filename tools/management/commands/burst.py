"""The burst drill (see tools.drills.burst). Exits non-zero when an invariant fails.

python manage.py burst                                   # 12,000 holds over 300 s
python manage.py burst --holds 2000 --window 30 --workers 3 --drain-at 10 --kill-at 15
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.core.management.base import CommandError, CommandParser

from cleanup.broker.celery_policy import broker_is_redis
from cleanup.conf import cleanup_settings
from reservations.commands import ProjectCommand, add_options
from tools.drills.burst import run
from tools.drills.state import BurstConfig


class Command(ProjectCommand):
    help = "Create a burst of expiring holds, watch it drain, check invariants, write a report."

    def add_arguments(self, parser: CommandParser) -> None:
        slo_default = f"CLEANUP_SLO_SECONDS, {cleanup_settings().slo_seconds}"
        add_options(parser, [
            ("--holds", int, 12000, "holds to create"),
            ("--window", float, 300.0, "seconds over which the holds expire; 0 = all at once"),
            ("--offerings", int, 8, "offerings the holds are spread over"),
            ("--shards", int, 4, "shards to send sweeps for (as the schedule's)"),
            ("--lead", float, 3.0, "seconds before the first hold expires"),
            ("--renew-fraction", float, 0.0,
             "fraction of the holds renewed before they expire, 0 to 1"),
            ("--duplicate-fraction", float, 0.0,
             "fraction of the release messages delivered twice (Redis), 0 to 1"),
            ("--workers", int, 0, "start K workers (0: target an already running fleet)"),
            ("--concurrency", int, 1, "pool processes of each started worker"),
            ("--drain-at", float, None,
             "SIGTERM one started worker at T s (default: none is drained)"),
            ("--kill-at", float, None,
             "SIGKILL one started worker at T s (default: none is killed)"),
            ("--sweep-every", float, 2.0, "seconds between the drill's sweeps"),
            ("--no-sweeps", bool, False, "do not send sweeps (a beat is running)"),
            ("--slo", float, None,
             f"SLO for the oldest eligible hold, seconds (default: {slo_default})"),
            ("--timeout", float, None,
             "give up after this many seconds (default: lead + window + 600)"),
            ("--out", Path, None, "directory for report.json, report.md and plot.png "
             "(default: reports/burst/<UTC timestamp>/)"),
            ("--seed", int, 1, "random seed of the renewed holds and the copied messages"),
            ("--set-based", int, 0,
             "after the drain, release N fresh expired holds in one statement and report its "
             "rate beside the drain's (the database's own ceiling; 0: skip)"),
        ])  # fmt: skip

    def handle(self, *args: Any, **o: Any) -> None:
        if o["holds"] < 1 or o["window"] < 0:
            raise CommandError("--holds must be >= 1 and --window >= 0")
        for flag in ("renew_fraction", "duplicate_fraction"):
            if not 0 <= o[flag] <= 1:
                raise CommandError(f"--{flag.replace('_', '-')} must be in [0, 1]")
        if o["duplicate_fraction"] and not broker_is_redis():
            # the duplicates are copies of queued envelopes (tools/drills/burst.py)
            raise CommandError("--duplicate-fraction needs a Redis broker")
        if (o["drain_at"] is not None or o["kill_at"] is not None) and not o["workers"]:
            raise CommandError("--drain-at/--kill-at need --workers (workers it started)")
        out = o["out"] or Path("reports/burst") / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        cfg = BurstConfig(
            holds=o["holds"],
            window=o["window"],
            offerings=o["offerings"],
            shards=o["shards"],
            lead=o["lead"],
            renew_fraction=o["renew_fraction"],
            duplicate_fraction=o["duplicate_fraction"],
            drain_at=o["drain_at"],
            kill_at=o["kill_at"],
            workers=o["workers"],
            concurrency=o["concurrency"],
            send_sweeps=not o["no_sweeps"],
            sweep_every=o["sweep_every"],
            set_based=o["set_based"],
            slo=o["slo"] or float(cleanup_settings().slo_seconds),
            timeout=o["timeout"],
            out=out,
            seed=o["seed"],
        )
        report = run(cfg)
        s = report["summary"]
        self.stdout.write(
            f"released {s['released']:,}/{report['holds']:,}; peak oldest eligible "
            f"{s['peak_oldest_eligible_s']} s (SLO {s['slo_s']:g}); outcomes {s['outcomes']}"
        )
        plot = report["plot"]
        if plot["written"]:
            self.stdout.write(f"report: {out / 'report.md'}  plot: {plot['path']}")
        else:
            self.stdout.write(f"report: {out / 'report.md'}  ({plot['note']})")
        if not report["invariants"]["ok"]:
            for v in report["invariants"]["violations"]:
                self.stderr.write(f"INVARIANT FAILED: {v}")
            raise SystemExit(1)
        self.stdout.write("invariants: all OK")
