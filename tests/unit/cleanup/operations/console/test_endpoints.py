"""/metrics protection, /healthz, /readyz, gauges vs SQL ground truth, the capped count, scrape
errors, the compactor's arithmetic, production settings' FLOWER_BASIC_AUTH, the holder in logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from cleanup.operations.console.endpoints import metrics_registry
from cleanup.operations.console.gauges import BacklogCollector
from common.db import rows
from tests.support import ROOT
from tests.support.fleet import create_eligible_holds
from tools.seed import seed_holds

# Every test starts and ends with the tests' own Redis database empty.
pytestmark = pytest.mark.usefixtures("broker")


def scrape(client: Client, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    out = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# --- access ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_metrics_refuses_anonymous_when_a_token_is_set(client: Client, settings) -> None:
    settings.METRICS_TOKEN = "s3cret"
    settings.METRICS_ALLOW_IPS = []
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200


@pytest.mark.django_db
def test_metrics_allowlist_and_fail_closed(client: Client, settings) -> None:
    settings.METRICS_TOKEN = ""
    settings.METRICS_ALLOW_IPS = ["10.0.0.0/8"]
    assert client.get("/metrics").status_code == 403  # test client is 127.0.0.1
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200
    settings.METRICS_ALLOW_IPS = []
    settings.DEBUG = False
    assert client.get("/metrics").status_code == 403  # neither set, not DEBUG: refuse
    settings.DEBUG = True
    assert client.get("/metrics").status_code == 200


# --- health ---------------------------------------------------------------------------------


def test_healthz(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


# A Redis URL where nothing listens: /readyz's broker check meets a real refused connection.
# (Unit tests run on Redis; the check reads the URL from the settings on every call.)
UNREACHABLE_BROKER = "redis://127.0.0.1:1/0"


@pytest.mark.django_db
def test_readyz_reports_dependencies_with_timings_to_a_metrics_reader(
    client: Client, settings
) -> None:
    settings.METRICS_TOKEN = "t" * 40
    auth = "Bearer " + "t" * 40
    started = time.perf_counter()
    body = client.get("/readyz", HTTP_AUTHORIZATION=auth).json()
    request_ms = (time.perf_counter() - started) * 1000
    assert body["ready"] is True
    assert body["checks"]["database"]["ok"] and body["checks"]["broker"]["ok"]
    # each check's time is in milliseconds and part of the request's own time
    for check in ("database", "broker"):
        assert 0 <= body["checks"][check]["ms"] <= request_ms, (body, request_ms)

    # when: the broker is unreachable (a port where nothing listens)
    settings.CELERY_BROKER_URL = UNREACHABLE_BROKER
    response = client.get("/readyz", HTTP_AUTHORIZATION=auth)
    assert response.status_code == 503
    error = response.json()["checks"]["broker"]["error"]
    assert error.startswith("ConnectionError: ") and "127.0.0.1:1" in error, error


@pytest.mark.django_db
def test_readyz_tells_anyone_the_status_but_not_hosts_or_errors(client: Client, settings) -> None:
    settings.METRICS_TOKEN = "t" * 40
    settings.DEBUG = False

    settings.CELERY_BROKER_URL = UNREACHABLE_BROKER
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {
        "ready": False,
        "checks": {"database": {"ok": True}, "broker": {"ok": False}},
    }
    assert b"127.0.0.1" not in response.content
    wrong = client.get("/readyz", HTTP_AUTHORIZATION="Bearer nope")
    assert b"10.0.0.5" not in wrong.content


# --- gauges ---------------------------------------------------------------------------------


def truth_oldest(shards: int, k: int) -> float:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(expires_at)), 0)::float8 "
            "FROM reservations_reservation WHERE status='held' AND expires_at <= now() "
            "AND bucket %% %s = %s",
            [shards, k],
        )
        return float(cur.fetchone()[0])


def truth_count(shards: int, k: int) -> int:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM reservations_reservation WHERE status='held' "
            "AND expires_at <= now() AND bucket %% %s = %s",
            [shards, k],
        )
        return int(cur.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_gauges_equal_sql_ground_truth_and_count_caps(client: Client, settings) -> None:
    from cleanup.release.schedule import install_schedule

    settings.METRICS_TOKEN = "t"
    install_schedule(4, 10)
    # expired 2 to 32 minutes ago (hold p: 120 + 6p s), every shard holding old and recent
    # ones, so the oldest and the newest of a shard are far apart
    seed_holds(300, offerings=3, expires_in=lambda p: -(120.0 + 6.0 * p), name="gauges")
    ids_fresh = create_eligible_holds(40, offerings=1, expired_seconds_ago=30)
    with connection.cursor() as cur:  # 40 not yet expired: not eligible
        cur.execute(
            "UPDATE reservations_reservation SET expires_at = now() + interval '1 hour', "
            "next_attempt_at = now() + interval '1 hour' WHERE id = ANY(%s)",
            [ids_fresh],
        )
    settings.CLEANUP_ELIGIBLE_COUNT_CAP = 1000

    before = [truth_oldest(4, k) for k in range(4)]
    m = scrape(client, "t")
    after = [truth_oldest(4, k) for k in range(4)]

    for k in range(4):
        shard = (("shard", str(k)),)
        got = m[("reservation_cleanup_oldest_eligible_reservation_age_seconds", shard)]
        # the age of the shard's oldest eligible hold when the scrape read it: between the
        # ages SQL reads just before and just after the scrape, however long the scrape took
        assert before[k] <= got <= after[k], (k, before[k], got, after[k])
        assert m[("reservation_cleanup_eligible_reservations", shard)] == truth_count(4, k)
        assert m[("reservation_cleanup_eligible_reservations_capped", shard)] == 0
    assert sum(truth_count(4, k) for k in range(4)) == 300
    q = (("queue", "cleanup"),)
    assert m[("reservation_cleanup_queue_depth", q)] == 0
    assert m[("reservation_cleanup_queue_oldest_message_age_seconds", q)] == 0
    assert m[("reservation_cleanup_dead_letters_open", (("reason", "malformed"),))] == 0
    assert ("reservation_cleanup_outbox_oldest_unpublished_age_seconds", ()) in m
    assert any(name == "process_cpu_seconds_total" for name, _ in m)  # the process's own

    settings.CLEANUP_ELIGIBLE_COUNT_CAP = 10
    m = scrape(client, "t")
    for k in range(4):
        shard = (("shard", str(k)),)
        assert m[("reservation_cleanup_eligible_reservations", shard)] == 10
        assert m[("reservation_cleanup_eligible_reservations_capped", shard)] == 1


@pytest.mark.django_db(transaction=True)
def test_a_failing_section_keeps_its_last_value_and_counts_an_error(settings) -> None:
    create_eligible_holds(5, offerings=1, expired_seconds_ago=100)
    collector = BacklogCollector()
    first = {m.name: m for m in collector.collect()}
    age = first["reservation_cleanup_oldest_eligible_reservation_age_seconds"].samples[0].value
    assert age >= 100
    settings.METRICS_STATEMENT_TIMEOUT_MS = 1
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(1)")
    # A statement that sleeps past the 1 ms timeout stands in for a slow backlog query.
    original = collector.read_eligible

    def slow() -> dict:
        def run() -> dict:
            rows("SELECT pg_sleep(0.1)")
            return {}

        return collector._db(run)

    collector.read_eligible = slow  # type: ignore[method-assign]
    second = {m.name: m for m in collector.collect()}
    collector.read_eligible = original  # type: ignore[method-assign]
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_unlock(1)")
    kept = second["reservation_cleanup_oldest_eligible_reservation_age_seconds"].samples[0].value
    assert kept == age
    errors = {
        s.labels["collector"]: s.value for s in second["reservation_cleanup_scrape_errors"].samples
    }
    assert errors["eligible"] == 1 and errors["queues"] == 0
    # The per-scrape gauge (what the alert counts): 1 for the failed section in this scrape,
    # back to 0 in the next good scrape.
    failed = {
        s.labels["collector"]: s.value for s in second["reservation_cleanup_scrape_failed"].samples
    }
    assert failed["eligible"] == 1 and failed["queues"] == 0
    settings.METRICS_STATEMENT_TIMEOUT_MS = 2000
    third = {m.name: m for m in collector.collect()}
    failed = {
        s.labels["collector"]: s.value for s in third["reservation_cleanup_scrape_failed"].samples
    }
    assert set(failed.values()) == {0.0}


@pytest.mark.django_db
def test_the_slo_setting_is_exported_for_the_rules_and_dashboards(client: Client, settings) -> None:
    settings.METRICS_TOKEN = "t" * 40
    settings.CLEANUP_SLO_SECONDS = 45
    metrics = scrape(client, "t" * 40)
    assert metrics[("reservation_cleanup_slo_seconds", ())] == 45


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


def test_known_label_values_cover_the_dead_letter_reasons_and_tasks() -> None:
    """Counters created at 0 when a worker starts: every dead-letter reason and every cleanup
    task, so retries and dead letters show 0, not nothing, on a healthy fleet."""
    import cleanup.tasks  # noqa: F401 - registers the tasks
    from cleanup import metrics
    from cleanup.models import DeadLetter
    from config.celery_app import app as current_app

    assert set(metrics.KNOWN_DEAD_LETTER_REASONS) == set(DeadLetter.Reason.values)
    registered = {name for name in current_app.tasks if name.startswith("cleanup.")}
    assert set(metrics.KNOWN_TASKS) == registered
    metrics.initialize_worker_series()
    samples = {
        (s.name, s.labels.get("reason") or s.labels.get("task"))
        for family in [*metrics.RETRIES.collect(), *metrics.DEAD_LETTERS.collect()]
        for s in family.samples
    }
    assert ("reservation_cleanup_retries_total", "cleanup.release_reservation") in samples
    assert ("reservation_cleanup_dead_letters_total", "deliveries_exhausted") in samples


def test_collector_is_not_registered_at_import() -> None:
    from prometheus_client import REGISTRY

    gauge = "reservation_cleanup_oldest_eligible_reservation_age_seconds"
    assert gauge not in {m.name for m in REGISTRY.collect()}
    assert any(isinstance(c, BacklogCollector) for c in metrics_registry()._collector_to_names)


# --- worker metrics compaction --------------------------------------------------------------


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


# Whoever imports the metrics first, in a worker they are constructed in multiprocess mode: here
# before config and before anything else of the project, after prometheus_client itself (as
# Flower's CLI plugin imports it before ``-A config`` is loaded). Break: metrics.py without its
# ``ensure_prepared()`` call (the value files are never written).
STARTUP_ORDERS = {
    "metrics first": "from cleanup import metrics",
    "app first": "import config.celery_app\nfrom cleanup import metrics",
}


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
def test_a_worker_prepares_once_and_under_the_project_by_default(monkeypatch) -> None:
    from cleanup import metrics_boot

    monkeypatch.setenv("WORKER_METRICS_PORT", "9999")
    monkeypatch.delenv("WORKER_METRICS_DIR", raising=False)
    argv = ["/venv/bin/celery", "-A", "config", "worker", "-n", "default-dir-test@box"]
    path = metrics_boot.prepare(argv)
    try:
        assert path == ROOT / "var" / "prometheus" / "default-dir-test@box"
    finally:
        if path is not None:
            path.rmdir()
    # in this (test) process: prepared once, at the first import of the metrics, as no worker
    assert metrics_boot.ensure_prepared() is None and metrics_boot._prepared == [None]


def test_cleanup_reaches_the_configured_app_from_any_thread() -> None:
    """cleanup's modules use ``celery.current_app`` (they never import config): in a thread
    other than the one that created the app, it must still be the configured app."""
    import threading

    from celery import current_app

    from config.celery_app import app

    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(current_app.main))
    thread.start()
    thread.join()
    assert seen == [app.main] == ["reservations"]


# --- settings and logs ----------------------------------------------------------------------


def test_the_holder_is_never_logged() -> None:
    """No log call in cleanup/ or reservations/ passes the holder (grep-level check)."""
    offenders = []
    for path in [*ROOT.glob("cleanup/**/*.py"), *ROOT.glob("reservations/**/*.py")]:
        text = path.read_text()
        for match in re.finditer(r"(logger|logging)\.\w+\((?:[^()]|\([^()]*\))*\)", text):
            if "holder" in match.group(0):
                offenders.append(f"{path}: {match.group(0)[:80]}")
    assert offenders == []


@pytest.mark.parametrize("amount", [0.0, 0.004, 0.005, 0.3, 7.5, 1e9])
@pytest.mark.parametrize("times", [1, 2, 500])
def test_observing_an_amount_n_times_at_once_records_what_n_observations_do(
    amount: float, times: int
) -> None:
    """A batch message records its holds' shared duration at once (``observe_times``, which
    writes prometheus_client's histogram fields itself): the exposition must be exactly that of
    ``times`` calls of ``observe``, at a bucket's bound, between bounds and past the last."""
    from prometheus_client import CollectorRegistry, Histogram

    from cleanup.metrics import observe_times

    def samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        # every sample but the histogram's creation time
        return [
            (s.name, s.labels, s.value)
            for family in registry.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        ]

    one_by_one, at_once = CollectorRegistry(), CollectorRegistry()
    buckets = (0.005, 0.05, 0.5, 5.0)
    calls = Histogram("h", "h", buckets=buckets, registry=one_by_one)
    batch = Histogram("h", "h", buckets=buckets, registry=at_once)
    for _ in range(times):
        calls.observe(amount)
    observe_times(batch, amount, times)
    batched, called = samples(at_once), samples(one_by_one)
    # the same samples; the sum up to float rounding (n additions against one product)
    assert [(name, labels) for name, labels, _ in batched] == [(n, lb) for n, lb, _ in called]
    assert [value for *_, value in batched] == pytest.approx([value for *_, value in called])


def test_a_batchs_outcomes_count_each_hold() -> None:
    from prometheus_client import REGISTRY

    from cleanup import metrics

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    before = (
        value("reservation_cleanup_outcomes_total", {"outcome": "released"}),
        value("reservation_cleanup_transitions_total"),
        value("reservation_cleanup_processing_duration_seconds_count"),
    )
    metrics.record_outcome("released", 0.002, 1.5, holds=37)
    after = (
        value("reservation_cleanup_outcomes_total", {"outcome": "released"}),
        value("reservation_cleanup_transitions_total"),
        value("reservation_cleanup_processing_duration_seconds_count"),
    )
    assert [b - a for a, b in zip(before, after, strict=True)] == [37, 37, 37]


@pytest.mark.django_db(transaction=True)
def test_a_duplicate_release_is_counted_as_already_handled_and_moves_no_transition(
    client: Client, settings, run_task
) -> None:
    """What an operator reads on /metrics after a duplicate delivery: one release, one
    duplicate, one transition (a duplicate counted as released would hide the duplicates and
    inflate the transitions)."""
    from cleanup.release.messages import build
    from cleanup.release.publish import RELEASE_TASK
    from reservations.models import Reservation

    settings.METRICS_TOKEN = "t" * 40
    outcome = "reservation_cleanup_outcomes_total"
    watched = {
        "released": (outcome, (("outcome", "released"),)),
        "already_handled": (outcome, (("outcome", "already_handled"),)),
        "transitions": ("reservation_cleanup_transitions_total", ()),
    }

    def read() -> dict[str, float]:
        m = scrape(client, "t" * 40)
        return {name: m.get(key, 0.0) for name, key in watched.items()}

    (hold_id,) = create_eligible_holds(1, offerings=1)
    expires_at = Reservation.objects.get(pk=hold_id).expires_at
    message = build(hold_id, 1, expires_at, 0, "duplicate")
    before = read()
    # when: the same release message is delivered twice (a redelivery after a lost ack)
    first = run_task(RELEASE_TASK, message, task_id="first")
    second = run_task(RELEASE_TASK, dict(message), task_id="second")
    assert (first["outcome"], second["outcome"]) == ("released", "already_handled")
    # then
    after = read()
    moved = {name: after[name] - before[name] for name in watched}
    assert moved == {"released": 1, "already_handled": 1, "transitions": 1}
