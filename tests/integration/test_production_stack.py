"""The production stack as a whole: docker-compose.yml's own services, wiring and
production settings, run as processes in network namespaces (tests/support/prodstack.py),
with Debian's Prometheus and Alertmanager on deploy/prometheus.yml, deploy/alerts.yml and
deploy/alertmanager.yml unchanged. Checks what an operator looks at first:

1. every metric named in alerts.yml, every dashboard panel's query and every query in deploy/k8s
   returns a series from the live Prometheus (Grafana itself is not packaged in Debian);
2. holds expire while the workers are stopped: the SLO alert goes pending, then firing, and
   Alertmanager's API shows it; workers back, it resolves. A poison message (its delivery count
   at the cap) fires the dead-letter alert; requeueing the letter clears it;
3. the web answers behind gunicorn with production settings: /readyz, and the admin login with
   the user docs/DEPLOY.md's first-user step creates;
4. the backlog autoscaler grows the worker's pool to its maximum when the workers come back to
   holds older than the SLO ("slo_at_risk"), and shrinks it to its minimum once the backlog is
   gone and the cooldown has passed (docs/AUTOSCALING.md), as Prometheus sees it.

Runs as root with iproute2 (network namespaces) and Debian's prometheus,
prometheus-alertmanager, postgresql, redis-server and docker-compose; scripts/test.sh installs
them in CI. Elsewhere a missing piece skips the test with the reason; in CI it fails.
"""

from __future__ import annotations

import os
import re
import shlex
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from tests.support.missing_tools import skip_for_missing
from tests.support.prodstack import (
    ROOT,
    Browser,
    Stack,
    alert_rules,
    dashboard_queries,
    k8s_queries,
    missing_tools,
    selectors,
)
from tests.support.quick_start import quick_start_env

pytestmark = [pytest.mark.drill, pytest.mark.slow, pytest.mark.timeout(420)]

SLO_SECONDS = 60
POOL_MIN, POOL_MAX = 1, 3
# The operator's .env: scripts/make_env.py's output (fresh secrets) with a few settings of the
# settings table (docs/CONFIGURATION.md), set the way an operator would set them, to keep the
# drill short and small.
DRILL_SETTINGS = {
    "CLEANUP_SLO_SECONDS": str(SLO_SECONDS),
    "CLEANUP_SHARDS": "2",
    "CLEANUP_SWEEP_EVERY": "2",
    "WEB_CONCURRENCY": "2",
    "WORKER_AUTOSCALE_MIN": str(POOL_MIN),
    "WORKER_AUTOSCALE_MAX": str(POOL_MAX),
    # The shrink waits this long after the backlog is gone (60 s by default).
    "CLEANUP_AUTOSCALE_COOLDOWN": "20",
    "LOG_FORMAT": "text",
    # The measured per-consumer rate (docs/DEPLOY.md, "Capacity": from a burst report). Without
    # it the desired consumers gauge needs receipts of the last minute, and an idle fleet
    # exports none.
    "CLEANUP_CAPACITY_PER_CONSUMER_PER_S": "20",
}
SLO_ALERT = "ReservationCleanupSLOBreach"
DEAD_LETTER_ALERT = "ReservationCleanupDeadLetters"


def _unavailable(reason: str) -> None:
    # a skip outside CI, a failure in CI (tests/support/missing_tools.py)
    skip_for_missing("production-stack tools", reason)


def _dotenv() -> dict[str, str]:
    return {**quick_start_env(), **DRILL_SETTINGS}


def _manage_py_shell(code: str) -> list[str]:
    return ["python", "manage.py", "shell", "-c", code]


def _seed(stack: Stack, count: int, expires_in: float, name: str) -> None:
    """`docker compose run --rm migrate python manage.py shell -c …` (the one-off is the web's
    image and environment; it runs in the migrate service's namespace)."""
    code = (
        "from tools.seed import seed_holds; "
        f"print(len(seed_holds({count}, offerings=2, expires_in={expires_in}, name={name!r})))"
    )
    done = stack.services["migrate"].oneoff(_manage_py_shell(code))
    assert done.returncode == 0 and done.stdout.strip().endswith(str(count)), done.stderr[-2000:]


POISON = """
import uuid
from django.conf import settings
from cleanup.broker import signing
from cleanup.models import DeliveryCount
from cleanup.release.messages import build, validate
from cleanup.wire import RELEASE_TASK
from config.celery_app import app
from reservations.models import Reservation
from tools.seed import seed_holds
hold = Reservation.objects.get(pk=seed_holds(1, offerings=1, expires_in=3600, name="poison")[0])
message = build(hold.pk, hold.version, hold.expires_at, 0, "drill-poison")
key = validate(message).idempotency_key
# What a message that crashed its worker on every delivery leaves: its key counted at the cap.
DeliveryCount.objects.update_or_create(
    pk=key, defaults={"count": settings.CLEANUP_MAX_DELIVERIES})
task_id = str(uuid.uuid4())
app.send_task(RELEASE_TASK, args=(message,), queue=settings.CLEANUP_RELEASE_QUEUE, retries=1,
              task_id=task_id, headers=signing.signed_headers(task_id, RELEASE_TASK, (message,)))
print("poison", hold.pk, key)
"""


def _first_user_command() -> tuple[dict[str, str], list[str]]:
    """docs/DEPLOY.md's non-interactive first-user step, as documented (docker compose exec)."""
    guide = (ROOT / "docs" / "DEPLOY.md").read_text()
    line = next(
        line.strip()
        for line in guide.splitlines()
        if line.strip().startswith("docker compose exec -e DJANGO_SUPERUSER_PASSWORD")
    )
    words = shlex.split(line)
    assert words[:3] == ["docker", "compose", "exec"], line
    env: dict[str, str] = {}
    rest = words[3:]
    while rest[0] == "-e":
        key, _, value = rest[1].partition("=")
        env[key] = value
        rest = rest[2:]
    assert rest[0] == "web", line
    return env, rest[1:]


def _queries() -> list[tuple[str, str]]:
    """(where, query) for every selector of every alert rule, every dashboard panel target,
    every KEDA trigger and every HPA external metric."""
    found: list[tuple[str, str]] = []
    for rule in alert_rules():
        found += [
            (f"alerts.yml {rule['alert']}", f"count({_without_error_status(s)})")
            for s in selectors(rule["expr"])
        ]
    found += [(f"dashboard {title}", expr) for title, expr in dashboard_queries()]
    for where, expr in k8s_queries():
        if re.fullmatch(r"[a-z_:][a-z0-9_:]*", expr):  # an HPA metric name
            expr = f"count({expr})"
        found.append((f"k8s {where}", expr))
    return list(dict.fromkeys(found))


def _without_error_status(selector: str) -> str:
    """A selector without its 5xx status matcher: the drill's requests are answered without
    errors, so an error rate's numerator has no series yet; the metric and every other label
    are still checked."""
    return re.sub(r',?\s*status=~"5\.\."', "", selector).replace("{,", "{").replace("{}", "")


def _empty_queries(stack: Stack, at: float | None = None) -> list[str]:
    """The queries that return no series, as `where: query`."""
    return [f"{where}: {expr}" for where, expr in _queries() if not stack.query(expr, at=at)]


def _target_report(stack: Stack) -> str:
    return "\n".join(
        f"  {t['labels'].get('job')} {t['scrapeUrl']} health={t['health']} "
        f"lastError={t.get('lastError') or '-'}"
        for t in stack.targets()
    )


def _scraped_twice(stack: Stack) -> bool:
    for component in ("web", "worker", "flower"):
        found = stack.query(f'min(count_over_time(up{{component="{component}"}}[2m]))')
        if not found or float(found[0]["value"][1]) < 2:
            return False
    return True


@pytest.fixture
def stack() -> Any:
    if os.geteuid() != 0:
        _unavailable("network namespaces and the private servers need root")
    missing = missing_tools()
    if missing:
        _unavailable(f"missing: {', '.join(missing)} (Debian packages; CI installs them)")
    rig = Stack(_dotenv())
    try:
        yield rig
    finally:
        for name, service in rig.services.items():
            if service.process is not None and service.process.poll() not in (None, 0):
                print(f"--- {name} exited {service.process.returncode}:\n{service.log_tail(15)}")
        rig.down()


def test_the_compose_stack_serves_alerts_and_the_admin_as_deployed(stack: Stack) -> None:
    started = time.monotonic()
    stack.up(seed=lambda s: _seed(s, 40, -5, "drill-warmup"))
    for name in ("web", "worker", "beat", "flower"):
        stack.wait_healthy(name)
    stack.note("web, worker, beat, flower healthy (compose's own health checks)")

    # --- 3. the web behind gunicorn, production settings, /readyz, the first admin user ---------
    status, body, headers = stack.http("web", 8000, "/readyz", host="localhost:8000")
    assert status == 200 and b'"ready": true' in body, body
    assert headers.get("Server", "").startswith("gunicorn"), headers
    settings_module = stack.services["web"].exec(
        ["python", "-c", "import os; print(os.environ['DJANGO_SETTINGS_MODULE'])"]
    )
    assert settings_module.stdout.strip() == "config.settings.production"
    env, argv = _first_user_command()
    created = stack.services["web"].exec(argv, env=env)
    assert created.returncode == 0, created.stderr[-2000:]
    username = argv[argv.index("--username") + 1]
    browser = Browser(stack)
    status, page, final = browser.login(username, env["DJANGO_SUPERUSER_PASSWORD"])
    assert status == 200 and final == "/admin/" and "Site administration" in page, page[:800]
    status, page, _ = browser.request("/admin/cleanup/health/")
    assert status == 200 and "Cleanup health" in page, page[:500]
    # the API as a client first meets it: its description (the request metrics' series)
    status, page, _ = browser.request("/api/v1/openapi.json")
    assert status == 200 and '"openapi"' in page, page[:500]
    stack.note(f"web: /readyz 200 behind gunicorn; admin login as {username!r} (DEPLOY.md's step)")

    # --- Prometheus scrapes every target as compose wires it (web:8000, DNS for workers) -----
    def all_up() -> bool:
        targets = stack.targets()
        components = {t["labels"].get("component") for t in targets if t["health"] == "up"}
        return components >= {"web", "worker", "flower"}

    try:
        stack.wait(all_up, 60, "Prometheus to scrape web, worker and flower")
    except AssertionError as failed:
        raise AssertionError(f"{failed}; Prometheus's targets:\n{_target_report(stack)}") from None
    stack.note("Prometheus scrapes web, worker (DNS) and flower")

    # --- the poison message: dead-lettered on its last delivery --------------------------------
    poisoned = stack.services["web"].oneoff(_manage_py_shell(POISON))
    assert poisoned.returncode == 0, poisoned.stderr[-2000:]
    stack.wait(
        lambda: stack.query(
            'sum(reservation_cleanup_dead_letters_open{reason="deliveries_exhausted"}) > 0'
        ),
        60,
        "the poison message's dead letter in Prometheus",
    )
    stack.note("poison message dead-lettered (deliveries_exhausted), seen by Prometheus")

    # --- 1. every metric and query returns a series --------------------------------------------
    try:
        stack.wait(lambda: _scraped_twice(stack) and not _empty_queries(stack), 90,
                   "every query to return a series")  # fmt: skip
    except AssertionError:
        empty = _empty_queries(stack)
        raise AssertionError(
            f"{len(empty)} of {len(_queries())} queries return no series:\n  "
            + "\n  ".join(empty)
            + f"\nPrometheus's targets:\n{_target_report(stack)}"
        ) from None
    checked = [f"{where}: {expr}" for where, expr in _queries()]
    stack.note(f"all {len(checked)} queries return a series:\n  " + "\n  ".join(checked))

    # --- 2. the SLO alert: workers stopped, holds expire -----------------------------------------
    stack.services["worker"].stop(timeout=45)  # docker compose stop worker
    _seed(stack, 60, -(SLO_SECONDS * 3), "drill-slo")
    stack.note(f"worker stopped; 60 holds expired {SLO_SECONDS * 3} s ago (SLO {SLO_SECONDS} s)")
    times: dict[str, float] = {}

    def reached(name: str, state: str) -> bool:
        if stack.alerts().get(name) == state:
            times.setdefault(f"{name} {state}", time.monotonic() - stack.t0)
            return True
        return False

    stack.wait(lambda: reached(SLO_ALERT, "pending"), 90, f"{SLO_ALERT} pending")
    stack.note(f"{SLO_ALERT}: pending")
    stack.wait(lambda: reached(DEAD_LETTER_ALERT, "firing"), 150, f"{DEAD_LETTER_ALERT} firing")
    stack.note(f"{DEAD_LETTER_ALERT}: firing")
    stack.wait(lambda: reached(SLO_ALERT, "firing"), 180, f"{SLO_ALERT} firing")
    stack.note(f"{SLO_ALERT}: firing")

    def in_alertmanager(name: str) -> bool:
        return any(a["labels"]["alertname"] == name for a in stack.alertmanager_alerts())

    stack.wait(lambda: in_alertmanager(SLO_ALERT), 60, f"Alertmanager's API to show {SLO_ALERT}")
    assert in_alertmanager(DEAD_LETTER_ALERT)
    paged = next(a for a in stack.alertmanager_alerts() if a["labels"]["alertname"] == SLO_ALERT)
    assert paged["labels"]["severity"] == "critical"
    assert "critical" in [r["name"] for r in paged["receivers"]]
    stack.note(f"Alertmanager shows {SLO_ALERT} (receiver critical) and {DEAD_LETTER_ALERT}")
    # The on-call follows the alert's runbook link: the web serves the section it names.
    runbook = urllib.parse.urlsplit(paged["annotations"]["runbook_url"])
    status, page, _ = browser.request(runbook.path)
    assert status == 200 and f'id="{runbook.fragment}"' in page, page[:500]
    section = page.split(f'id="{runbook.fragment}"', 1)[1].split("<h2", 1)[0]
    assert "First three checks" in section and "Fix" in section, section[:800]
    stack.note(f"runbook_url {runbook.path}#{runbook.fragment}: its section, checks and fix")

    # workers back, and the operator requeues the dead letter
    stack.services["worker"].start()  # docker compose start worker
    requeued = stack.services["web"].exec(
        ["python", "manage.py", "requeue_dead_letters", "--reason", "deliveries_exhausted"]
    )
    assert requeued.returncode == 0 and "republished: 1" in requeued.stdout, requeued
    stack.note("worker started again; dead letter requeued (requeue_dead_letters)")

    # --- 4. the autoscaler grows the pool at once: the holds waiting are older than the SLO ---
    def pool_processes() -> float | None:
        found = stack.query("max(reservation_cleanup_worker_pool_processes)")
        return float(found[0]["value"][1]) if found else None

    stack.wait(lambda: pool_processes() == POOL_MAX, 90, f"the pool to grow to {POOL_MAX}")
    times.setdefault("pool grown", time.monotonic() - stack.t0)
    grown = stack.query('sum(reservation_cleanup_autoscale_decisions_total{action="grow"})')
    assert grown and float(grown[0]["value"][1]) >= 1, grown
    stack.note(f"autoscaler: pool grown to {POOL_MAX} (Prometheus)")

    def resolved(name: str) -> bool:
        if name not in stack.alerts():
            times.setdefault(f"{name} resolved", time.monotonic() - stack.t0)
            return True
        return False

    stack.wait(lambda: all([resolved(SLO_ALERT), resolved(DEAD_LETTER_ALERT)]), 120,
               "both alerts resolved")  # fmt: skip
    stack.wait(
        lambda: (
            not any(
                a["labels"]["alertname"] in (SLO_ALERT, DEAD_LETTER_ALERT)
                for a in stack.alertmanager_alerts()
            )
        ),
        60,
        "Alertmanager to drop the resolved alerts",
    )
    stack.note("both alerts resolved in Prometheus and gone from Alertmanager's active alerts")

    # --- 4. ... and shrinks it to the minimum once the backlog is gone and the cooldown passed ---
    stack.wait(lambda: pool_processes() == POOL_MIN, 120, f"the pool to shrink to {POOL_MIN}")
    times.setdefault("pool shrunk", time.monotonic() - stack.t0)
    shrunk = stack.query('sum(reservation_cleanup_autoscale_decisions_total{action="shrink"})')
    assert shrunk and float(shrunk[0]["value"][1]) >= 1, shrunk
    stack.note(f"autoscaler: pool shrunk to {POOL_MIN} after the cooldown (Prometheus)")
    print("\nalert timeline (seconds since the drill started):")
    for what, at in sorted(times.items(), key=lambda kv: kv[1]):
        print(f"  {at:6.1f}  {what}")
    print(f"drill run time: {time.monotonic() - started:.0f} s")
    assert times[f"{SLO_ALERT} pending"] < times[f"{SLO_ALERT} firing"]
    assert times[f"{SLO_ALERT} firing"] < times[f"{SLO_ALERT} resolved"]
    assert times["pool grown"] < times["pool shrunk"]
    (Path(stack.dir) / "timeline.txt").write_text(
        "\n".join(f"{at:.1f} {what}" for at, what in stack.timeline)
    )
