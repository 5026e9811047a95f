"""Worker-side metrics (cleanup.operations.worker_metrics): every worker serves its pool size, and
the compaction of dead processes' files keeps the totals and bounds the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

# Every test starts and ends with the tests' own Redis database empty.
pytestmark = pytest.mark.usefixtures("broker")


def test_every_worker_serves_its_pool_size() -> None:
    """The no-consumer rule and the consumers panel read this gauge from every worker,
    autoscaled or not."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from cleanup.operations.worker_metrics import PoolCollector

    consumer = SimpleNamespace(pool=SimpleNamespace(num_processes=3))
    registry = CollectorRegistry()
    registry.register(PoolCollector(consumer))  # type: ignore[arg-type]
    assert "reservation_cleanup_worker_pool_processes 3.0" in generate_latest(registry).decode()
    consumer.pool = None  # type: ignore[assignment]
    assert "pool_processes" not in generate_latest(registry).decode()


def test_compaction_preserves_totals_and_bounds_files(tmp_path: Path) -> None:
    """Fold dead pids' files into one archive: same totals, one file per type."""
    script = f"""
import os, sys, subprocess
os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
from prometheus_client import Counter, Histogram, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
c = Counter("t_events", "x", ["k"]); h = Histogram("t_dur", "x", buckets=(1, 2))
pids = []
for i in range(30):
    pid = os.fork()
    if pid == 0:
        c.labels(k="a").inc(i); h.observe(1.5); os._exit(0)
    os.waitpid(pid, 0)
def total():
    r = CollectorRegistry(); MultiProcessCollector(r)
    return {{(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in r.collect() for s in m.samples}}
before = total()
from cleanup.operations.worker_metrics import compact
print(compact({str(tmp_path)!r}))
after = total()
assert before == after, (before, after)
print(sorted(f.replace(str(os.getpid()), "PARENT") for f in os.listdir({str(tmp_path)!r})))
print(before[("t_events_total", (("k", "a"),))], before[("t_dur_count", ())])
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "{'folded_files': 60, 'dead_pids': 30}"
    # Only the archives and the (live) parent's own file remain.
    assert lines[1] == "['counter_archive.db', 'histogram_PARENT.db', 'histogram_archive.db']"
    assert lines[2] == "435.0 30.0"


def test_compaction_leaves_no_file_of_a_dead_pool_process_for_the_project_metrics(
    tmp_path: Path,
) -> None:
    """Recycled pool processes that touched the project's own metrics (a release, a sweep, a
    sizing decision) leave nothing behind after one pass: their counters and histograms are
    archived, their gauges removed. Break: a gauge in cleanup.metrics with a non-live
    multiprocess mode (e.g. "mostrecent"): its dead processes' files stay, one per recycle."""
    script = f"""
import json, os, sys
os.environ["WORKER_METRICS_PORT"] = "9999"
os.environ["WORKER_METRICS_DIR"] = {str(tmp_path)!r}
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
sys.argv = ["/venv/bin/celery", "-A", "config", "worker", "-n", "recycle@box"]
from cleanup import metrics
path = os.environ["PROMETHEUS_MULTIPROC_DIR"]
children = []
for i in range(5):
    pid = os.fork()
    if pid == 0:
        metrics.record_outcome("released", 0.01, 0.5)
        metrics.record_sweep(0, 3, 3, 0.1, False, messages=1)
        metrics.record_message_sizes([3])
        metrics.record_sizing("backlog", 3)
        metrics.AUTOSCALE_POOL.set(2)
        os._exit(0)
    os.waitpid(pid, 0)
    children.append(pid)
from cleanup.operations.worker_metrics import compact
compact(path)
left = [f for f in os.listdir(path) if any(f.endswith(f"_{{pid}}.db") for pid in children)]
print(json.dumps(left))
"""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []
