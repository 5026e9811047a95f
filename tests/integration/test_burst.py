"""The burst drill end to end: it starts its own workers, drains one and kills another, and
exits 0 with its report, plot and summary written. Without matplotlib (the runtime environment)
it still writes its report and says why there is no plot; its progress is a bar redrawn in place
on a terminal and plain lines anywhere else."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import ROOT, scalar, service_env, sql

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


def _tiny_burst(out: Path, **popen: Any) -> "subprocess.Popen[Any]":
    """20 holds expiring at once, released by the session's running fleet (--workers 0)."""
    argv = [sys.executable, "manage.py", "burst", "--holds", "20", "--window", "0", "--lead", "1"]
    argv += ["--offerings", "2", "--sweep-every", "1", "--timeout", "120", "--out", str(out)]
    return subprocess.Popen(argv, cwd=ROOT, **popen)


def test_without_matplotlib_and_a_terminal_the_drill_reports_without_plot_in_plain_lines(
    clean, workers, tmp_path
):
    # given: the runtime environment, where matplotlib is not installed (a stand-in package
    # that fails to import, first on the path), and output into pipes, as into a log file
    hidden = tmp_path / "no-matplotlib" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = service_env(PYTHONPATH=str(hidden.parent))
    out = tmp_path / "burst"
    # when
    proc = _tiny_burst(out, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=200)
    # then: it finished, wrote its report and summary, no plot, and said why
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "invariants: all OK" in stdout
    assert "plot.png not written: matplotlib is not installed" in stdout
    assert not (out / "plot.png").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["released"] == 20
    assert report["plot"]["written"] is False
    assert "matplotlib is not installed" in report["plot"]["note"]
    assert "matplotlib is not installed" in (out / "report.md").read_text()
    # and its progress came as plain lines: no carriage return, the last one the drained state
    assert "\r" not in stdout + stderr
    progress = [line for line in stderr.splitlines() if line.startswith("[")]
    assert progress, stderr[-2000:]
    assert "released 20/20" in progress[-1]
    assert "eligible 0" in progress[-1]


def test_on_a_terminal_the_drill_redraws_its_progress_bar_and_plots(clean, workers, tmp_path):
    # given: a terminal for both outputs, and the dev requirements (matplotlib)
    import pty

    primary, secondary = pty.openpty()
    out = tmp_path / "burst"
    # when
    proc = _tiny_burst(out, env=service_env(), stdout=secondary, stderr=secondary)
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the terminal's other side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    rc = proc.wait(timeout=200)
    screen = b"".join(chunks).decode(errors="replace")
    # then: the bar was redrawn in place, ending on the drained state, and the plot written
    assert rc == 0, screen[-3000:]
    redraws = [part for part in screen.split("\r") if part.startswith("[")]
    assert len(redraws) >= 2, screen[-2000:]
    assert "released 20/20" in redraws[-1]
    assert "|########################|" in redraws[-1]
    assert (out / "plot.png").stat().st_size > 0
    assert json.loads((out / "report.json").read_text())["plot"]["written"] is True
