"""The burst drill end to end: it starts its own workers, drains one and kills another, and
exits 0 with its report, plot and summary written."""

import json
import subprocess
import sys

import pytest

from .fleet import ROOT, service_env

pytestmark = [pytest.mark.workers, pytest.mark.slow]


def test_small_burst_with_a_drain_and_a_kill_passes_its_invariant_checks(
    clean, exclusive_workers, tmp_path
):
    # given: 300 holds expiring over 5 s, three workers started by the drill
    out = tmp_path / "burst"
    # when
    proc = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "burst",
            "--holds",
            "300",
            "--window",
            "5",
            "--lead",
            "2",
            "--workers",
            "3",
            "--concurrency",
            "1",
            "--drain-at",
            "3",
            "--kill-at",
            "6",
            "--renew-fraction",
            "0.05",
            "--duplicate-fraction",
            "0.05",
            "--sweep-every",
            "2",
            "--timeout",
            "240",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=290,
        # A lease longer than the drill: the killed worker's messages come back through the
        # visibility timeout (15 s in test settings), not through re-claims of queued holds.
        env=service_env(CLEANUP_LEASE_SECONDS="120"),
    )
    # then
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for name in ("report.json", "report.md", "plot.png"):
        assert (out / name).stat().st_size > 0
    report = json.loads((out / "report.json").read_text())
    assert report["invariants"] == {"ok": True, "violations": []}
    assert [e["event"].split(" ")[0] for e in report["events"][1:]] == ["drain", "kill"]
    assert report["summary"]["released"] == 300 - report["renewed"]
