"""The burst drill end to end: it starts its own workers, drains one and kills another, and
exits 0 with its report, plot and summary written."""

import json
import subprocess
import sys

import pytest

from .fleet import ROOT, scalar, service_env, sql

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
            # Between two sweeps (sent every 2 s from t=0), so the kill lands on releases; a
            # kill mid-sweep has its own test (test_sweep_kill: the batch is due again at once).
            "--kill-at",
            "7",
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
    # and the database, read here and not through the drill's own checks, agrees: every hold
    # the drill renewed (version > 1) is still held and not yet expired, every other hold was
    # released once, at the version it had, with one receipt and one released event
    by_state = dict(
        sql(
            "SELECT (version > 1)::text || ':' || status, count(*) "
            "FROM reservations_reservation GROUP BY 1"
        )
    )
    assert by_state == {"true:held": report["renewed"], "false:released": 300 - report["renewed"]}
    assert (
        scalar(
            "SELECT count(*) FROM reservations_reservation WHERE status = 'held' "
            "AND expires_at <= now()"
        )
        == 0
    )
    once = sql(
        "SELECT r.id FROM reservations_reservation r WHERE r.status = 'released' AND "
        "(SELECT count(*) FROM cleanup_cleanupreceipt c WHERE c.reservation_id = r.id "
        " AND c.outcome = 'released' AND c.version = r.released_version) = 1 AND "
        "(SELECT count(*) FROM reservations_outboxevent e WHERE e.reservation_id = r.id "
        " AND e.kind = 'reservation.released' AND e.version = r.released_version) = 1"
    )
    assert len(once) == 300 - report["renewed"]
    assert (
        scalar("SELECT count(*) FROM cleanup_cleanupreceipt WHERE outcome = 'released'")
        == 300 - report["renewed"]
    )
    # seats: each offering's free seats plus its held holds make its capacity
    assert (
        sql(
            "SELECT o.id FROM reservations_offering o WHERE o.capacity <> o.seats_available + "
            "(SELECT count(*) FROM reservations_reservation r WHERE r.offering_id = o.id "
            " AND r.status IN ('held', 'confirmed'))"
        )
        == []
    )
    # the drain and the kill lost nothing and set nothing aside
    assert scalar("SELECT count(*) FROM cleanup_deadletter") == 0
