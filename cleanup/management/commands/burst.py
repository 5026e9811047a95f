"""The burst drill (see cleanup.drills.burst). Exits non-zero when an invariant fails.

python manage.py burst                                   # 12,000 holds over 300 s
python manage.py burst --holds 2000 --window 30 --workers 3 --drain-at 10 --kill-at 15
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.core.management.base import CommandError, CommandParser

from cleanup.conf import cleanup_settings
from cleanup.drills.burst import run
from cleanup.drills.state import BurstConfig
from reservations.management.base import ProjectCommand


class Command(ProjectCommand):
    help = "Create a burst of expiring holds, watch it drain, check invariants, write a report."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--holds", type=int, default=12000, help="holds to create")
        parser.add_argument(
            "--window",
            type=float,
            default=300.0,
            help="seconds over which the holds expire; 0 = all at once",
        )
        parser.add_argument(
            "--offerings", type=int, default=8, help="offerings the holds are spread over"
        )
        parser.add_argument(
            "--shards", type=int, default=4, help="shards to send sweeps for (as the schedule's)"
        )
        parser.add_argument(
            "--lead", type=float, default=3.0, help="seconds before the first hold expires"
        )
        parser.add_argument(
            "--renew-fraction",
            type=float,
            default=0.0,
            help="fraction of the holds renewed before they expire, 0 to 1",
        )
        parser.add_argument(
            "--duplicate-fraction",
            type=float,
            default=0.0,
            help="fraction of the release messages published a second time, 0 to 1",
        )
        parser.add_argument(
            "--workers",
            type=int,
            default=0,
            help="start K workers (0: target an already running fleet)",
        )
        parser.add_argument(
            "--concurrency", type=int, default=1, help="pool processes of each started worker"
        )
        parser.add_argument(
            "--drain-at",
            type=float,
            help="SIGTERM one started worker at T s (default: none is drained)",
        )
        parser.add_argument(
            "--kill-at",
            type=float,
            help="SIGKILL one started worker at T s (default: none is killed)",
        )
        parser.add_argument(
            "--sweep-every", type=float, default=2.0, help="seconds between the drill's sweeps"
        )
        parser.add_argument(
            "--no-sweeps", action="store_true", help="do not send sweeps (a beat is running)"
        )
        parser.add_argument(
            "--slo",
            type=float,
            help="SLO for the oldest eligible hold, seconds (default: CLEANUP_SLO_SECONDS, "
            f"{cleanup_settings().slo_seconds})",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            help="give up after this many seconds (default: lead + window + 600)",
        )
        parser.add_argument(
            "--out",
            type=Path,
            help="directory for report.json, report.md and plot.png "
            "(default: var/burst/<UTC timestamp>/)",
        )
        parser.add_argument(
            "--seed", type=int, default=1, help="random seed of the renew and duplicate choices"
        )

    def handle(self, *args: Any, **o: Any) -> None:
        if o["holds"] < 1 or o["window"] < 0:
            raise CommandError("--holds must be >= 1 and --window >= 0")
        for flag in ("renew_fraction", "duplicate_fraction"):
            if not 0 <= o[flag] <= 1:
                raise CommandError(f"--{flag.replace('_', '-')} must be in [0, 1]")
        if (o["drain_at"] is not None or o["kill_at"] is not None) and not o["workers"]:
            raise CommandError("--drain-at/--kill-at need --workers (workers it started)")
        out = o["out"] or Path("var/burst") / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
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
