"""prometheus_client's multiprocess mode for a worker (cleanup.metrics_boot): a directory per
worker, wiped at boot, prepared once whatever imports the metrics first."""

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


@pytest.fixture
def preparing_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``metrics_boot.prepare`` called in the test process changes it for every later test:
    it sets ``PROMETHEUS_MULTIPROC_DIR`` (to a directory the test then deletes) and re-selects
    prometheus_client's value class (multiprocess values, written as files there). Both are
    recorded here so they are put back after the test. The variable is set before it is
    deleted because ``monkeypatch.delenv`` records nothing for a variable that is not set, and
    then would not remove what ``prepare`` sets."""
    from prometheus_client import values

    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")


# Whoever imports the metrics first, in a worker they are constructed in multiprocess mode: here
# before config and before anything else of the project, after prometheus_client itself (as
# Flower's CLI plugin imports it before ``-A config`` is loaded). Break: metrics.py without its
# ``ensure_prepared()`` call (the value files are never written).
STARTUP_ORDERS = {
    "metrics first": "from cleanup import metrics",
    "app first": "import config.celery_app\nfrom cleanup import metrics",
}


@pytest.mark.usefixtures("preparing_in_this_process")
def test_worker_boot_sets_and_wipes_a_directory_per_worker(tmp_path: Path, monkeypatch) -> None:
    from cleanup import metrics_boot

    monkeypatch.setenv("WORKER_METRICS_PORT", "9999")
    monkeypatch.setenv("WORKER_METRICS_DIR", str(tmp_path))
    stale = tmp_path / "w1@box" / "counter_1.db"
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    argv = ["/venv/bin/celery", "-A", "config", "worker", "-n", "w1@box"]
    path = metrics_boot.prepare(argv)
    assert path == tmp_path / "w1@box" and not stale.exists()
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(path)
    assert metrics_boot.prepare(["/venv/bin/celery", "-A", "config", "beat"]) is None
    assert metrics_boot.worker_name(["celery", "worker", "--hostname=a@%h"]).startswith("a@")


@pytest.mark.parametrize("order", sorted(STARTUP_ORDERS))
def test_worker_metrics_are_multiprocess_whatever_the_import_order(
    order: str, tmp_path: Path
) -> None:
    script = f"""
import json, os, sys
os.environ["WORKER_METRICS_PORT"] = "9999"
os.environ["WORKER_METRICS_DIR"] = {str(tmp_path)!r}
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
sys.argv = ["/venv/bin/celery", "-A", "config", "worker", "-n", "order@box"]
import prometheus_client
{STARTUP_ORDERS[order]}
metrics.TRANSITIONS.inc()
print(os.environ["PROMETHEUS_MULTIPROC_DIR"])
print(json.dumps(sorted(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))))
"""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    directory, files = out.stdout.splitlines()
    assert directory == str(tmp_path / "order@box")
    assert any(name.startswith("counter_") for name in json.loads(files)), files


@pytest.mark.usefixtures("preparing_in_this_process")
def test_a_worker_prepares_once_and_under_its_working_directory_by_default(
    monkeypatch, tmp_path
) -> None:
    from cleanup import metrics_boot

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKER_METRICS_PORT", "9999")
    monkeypatch.delenv("WORKER_METRICS_DIR", raising=False)
    argv = ["/venv/bin/celery", "-A", "config", "worker", "-n", "default-dir-test@box"]
    path = metrics_boot.prepare(argv)
    try:
        assert path == tmp_path / "var" / "prometheus" / "default-dir-test@box"
    finally:
        if path is not None:
            path.rmdir()
    # in this (test) process: prepared once, at the first import of the metrics, as no worker
    assert metrics_boot.ensure_prepared() is None and metrics_boot._prepared == [None]
