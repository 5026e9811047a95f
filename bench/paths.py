"""Where one bench run writes: its JSON report and EXPLAIN output under ``reports/bench/``
(git-ignored, like every generated report) and its workers' logs under ``var/bench/``, both
named by the run's start time."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "reports" / "bench"

STAMP = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")

LOGS = ROOT / "var" / "bench" / STAMP
