"""The deployment files say what the code does: docker-compose.yml runs every service the system
needs, wired to the same settings; .env.example lists every variable it reads; the Kubernetes
manifests, alert rules and dashboard reference only metrics the project really exports.

(`docker-compose config -q --env-file .env.example` is run by scripts/test.sh when the
docker-compose package is installed.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT
from tests.support.missing_tools import skip_for_missing
from tests.support.quick_start import quick_start_env

METRIC = re.compile(r"\breservation_cleanup_[a-z_]+\b")
COMPOSE_VAR = re.compile(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)")


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def command(service: dict[str, Any]) -> str:
    value = service.get("command", [])
    return " ".join(value) if isinstance(value, list) else str(value)


def healthcheck(service: dict[str, Any]) -> str:
    test = service.get("healthcheck", {}).get("test", [])
    return " ".join(test) if isinstance(test, list) else str(test)


def exported_metrics() -> set[str]:
    """Every metric name the project serves: the worker/web counters and histograms (with the
    suffixes Prometheus gives them) and the web's scrape-time gauges."""
    from prometheus_client import REGISTRY

    from cleanup import metrics
    from cleanup.operations.console import gauges as collectors

    names: set[str] = set()
    for collector_names in REGISTRY._collector_to_names.values():
        if any(n.startswith(metrics.PREFIX) for n in collector_names):
            names.update(collector_names)
    names.update(f"{metrics.PREFIX}_{name}" for name in collectors.GAUGE_HELP)
    names.update(
        {
            f"{metrics.PREFIX}_scrape_errors_total",
            f"{metrics.PREFIX}_scrape_failed",
            f"{metrics.PREFIX}_scrape_duration_seconds",
            f"{metrics.PREFIX}_slo_seconds",
            f"{metrics.PREFIX}_worker_pool_processes",
        }
    )
    return names


def test_compose_runs_every_service_the_system_needs() -> None:
    services = compose()["services"]
    assert set(services) >= {
        "postgres", "redis", "migrate", "web", "worker", "beat", "flower", "prometheus", "grafana",
    }  # fmt: skip
    # web: a real WSGI server, health from /readyz
    assert command(services["web"]).startswith("gunicorn config.wsgi:application")
    assert "/readyz" in healthcheck(services["web"])
    # worker: an autoscaled pool (the backlog autoscaler is the configured class)
    assert "--autoscale=" in command(services["worker"])
    from cleanup.celery import app

    assert app.conf.worker_autoscaler == "cleanup.operations.scaling.autoscale:BacklogAutoscaler"
    # every long-running service has a health check
    for name in ("postgres", "redis", "web", "worker", "beat", "flower"):
        assert healthcheck(services[name]), f"{name} has no health check"
    assert "beat_health" in healthcheck(services["beat"])
    assert "/healthcheck" in healthcheck(services["flower"])
    # Redis requires a password, and the health check authenticates
    assert "--requirepass" in command(services["redis"])
    assert "REDISCLI_AUTH" in services["redis"]["environment"]
    # Prometheus with the alert rules, Grafana with the dashboard provisioned
    volumes = " ".join(services["prometheus"]["volumes"])
    assert "deploy/alerts.yml" in volumes and "deploy/prometheus.yml" in volumes
    volumes = " ".join(services["grafana"]["volumes"])
    assert "deploy/grafana/provisioning" in volumes and "deploy/grafana/dashboards" in volumes


def test_every_app_service_shares_one_configuration() -> None:
    services = compose()["services"]
    app_services = ["migrate", "web", "worker", "beat", "flower"]
    envs = [services[name]["environment"] for name in app_services]
    for key in ("DATABASE_URL", "CELERY_BROKER_URL", "SECRET_KEY", "DJANGO_SETTINGS_MODULE"):
        assert len({env[key] for env in envs}) == 1, key
    broker = envs[0]["CELERY_BROKER_URL"]
    assert broker.startswith("redis://:${REDIS_PASSWORD") and broker.endswith("@redis:6379/0")
    assert "@postgres:5432/" in envs[0]["DATABASE_URL"]
    assert envs[0]["DJANGO_SETTINGS_MODULE"] == "config.settings.production"


def test_scaling_the_worker_out_is_safe() -> None:
    worker = compose()["services"]["worker"]
    # no fixed name or host port (both would collide on --scale worker=N); a per-container name
    assert "container_name" not in worker and "ports" not in worker
    assert "worker@%h" in command(worker)


def test_env_example_lists_every_variable_compose_reads() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(COMPOSE_VAR.findall(text))
    example = {
        line.split("=", 1)[0].strip()
        for line in (ROOT / ".env.example").read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    }
    assert used, "no ${VAR} found: the pattern is broken"
    assert sorted(used - example) == []
    assert "GRAFANA_ADMIN_PASSWORD" in example


def test_prometheus_scrapes_flower_with_the_configured_user_not_a_hard_coded_one() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    flower = next(job for job in config["scrape_configs"] if job["job_name"] == "flower")
    assert flower["basic_auth"]["username"] == "__FLOWER_USER__"
    entrypoint = " ".join(compose()["services"]["prometheus"]["entrypoint"])
    assert "__FLOWER_USER__|$${FLOWER_BASIC_AUTH%%:*}" in entrypoint


K8S = ROOT / "deploy" / "k8s"


def _kustomization(directory: Path) -> dict[str, Any]:
    return dict(yaml.safe_load((directory / "kustomization.yaml").read_text()))


def _set_images(value: Any, images: list[dict[str, str]]) -> None:
    """kustomize's image transformer, for the fields this repository uses (name, newName,
    newTag, digest): every container and init container naming an image gets its pin."""
    if isinstance(value, dict):
        for key in ("containers", "initContainers"):
            for container in value.get(key, []):
                for image in images:
                    if container.get("image") == image["name"]:
                        pinned = image.get("newName", image["name"])
                        if image.get("digest"):
                            pinned += "@" + image["digest"]
                        elif image.get("newTag"):
                            pinned += ":" + image["newTag"]
                        container["image"] = pinned
        for child in value.values():
            _set_images(child, images)
    elif isinstance(value, list):
        for child in value:
            _set_images(child, images)


def k8s_documents(pattern: str | None = None) -> list[dict[str, Any]]:
    """Without ``pattern``: what `kubectl apply -k deploy/k8s/` applies (the kustomization's
    resources, images pinned). With one (``"**/*.yaml"``): every manifest file under
    deploy/k8s, the alternatives, the scrape configuration and the Prometheus Operator's files
    included, as written (kustomization files left out)."""
    docs: list[dict[str, Any]] = []
    if pattern is None:
        kustomization = _kustomization(K8S)
        for name in kustomization["resources"]:
            docs.extend(d for d in yaml.safe_load_all((K8S / name).read_text()) if d)
        _set_images(docs, kustomization.get("images", []))
        return docs
    for path in sorted(K8S.glob(pattern)):
        if path.name != "kustomization.yaml":
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def test_the_keda_scaled_object_targets_the_worker_on_exported_metrics() -> None:
    docs = k8s_documents()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert len(scaled) == 1
    target = scaled[0]["spec"]["scaleTargetRef"]["name"]
    assert target in deployments
    args = " ".join(deployments[target]["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--autoscale=" in args and "sweep,cleanup,maintenance" in args
    exported = exported_metrics()
    queried: set[str] = set()
    for trigger in scaled[0]["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        names = set(METRIC.findall(trigger["metadata"]["query"]))
        assert names, trigger
        queried |= names
    assert sorted(queried - exported) == []
    # the project's own signals, not the raw Redis list length
    assert "reservation_cleanup_desired_consumers" in queried
    assert "reservation_cleanup_oldest_eligible_reservation_age_seconds" in queried


def test_the_hpa_alternative_uses_exported_metrics() -> None:
    hpas = [d for d in k8s_documents("**/*.yaml") if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpas
    names = {m["external"]["metric"]["name"] for h in hpas for m in h["spec"]["metrics"]}
    assert names and sorted(names - exported_metrics()) == []


@pytest.mark.parametrize(
    "path",
    [
        "deploy/alerts.yml",
        "deploy/grafana/dashboards/reservation-cleanup.json",
        "deploy/k8s/keda-scaledobject.yaml",
        "deploy/k8s/alternatives/hpa-external-metric.yaml",
    ],
)
def test_alerts_and_dashboard_reference_only_exported_metrics(path: str) -> None:
    text = (ROOT / path).read_text()
    if path.endswith(".json"):
        json.loads(text)  # valid JSON
    names = set(METRIC.findall(text))
    assert names, f"{path} references no project metric"
    assert sorted(names - exported_metrics()) == []


def _interpolate(value: str, env: dict[str, str]) -> str:
    """compose's ${VAR}, ${VAR:-default}, ${VAR:?message} (enough for this file)."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
        if env.get(name):
            return env[name]
        if op == ":-":
            return arg
        raise AssertionError(f"{name} is required by docker-compose.yml: {arg}")

    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(?:(:-|:\?)([^}]*))?\}", one, value)


def _example_env() -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if "=" in line and line[0] != "#"
    )


def _start_web_settings(dotenv: dict[str, str], probe: str) -> Any:
    """Python with the web container's environment as docker-compose.yml builds it from
    ``dotenv`` (the whole file through env_file, then `environment`, which wins), running
    ``probe`` under config.settings.production."""
    import os
    import subprocess
    import sys

    web = compose()["services"]["web"]
    app_env = dict(dotenv) if web.get("env_file") == ".env" else {}
    app_env.update({k: _interpolate(str(v), dotenv) for k, v in web["environment"].items()})
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    env.update(app_env)
    return subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_the_quick_start_env_passes_the_production_settings_checks() -> None:
    """`scripts/make_env.py` + docker-compose.yml give the app containers an environment that
    config.settings.production accepts (it refuses weak or development secrets)."""
    probe = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.DEBUG, s.SECURE_SSL_REDIRECT, s.CELERY_BROKER_URL.split('@')[-1])"
    )
    done = _start_web_settings(quick_start_env(), probe)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "redis:6379/0"]


@pytest.mark.parametrize(
    ("example_variable", "refused_variable"),
    [
        ("POSTGRES_PASSWORD", "DATABASE_URL"),
        ("REDIS_PASSWORD", "CELERY_BROKER_URL"),
        ("FLOWER_BASIC_AUTH", "FLOWER_BASIC_AUTH"),
    ],
)
def test_an_example_credential_left_in_the_env_stops_the_app_containers(
    example_variable: str, refused_variable: str
) -> None:
    """.env.example copied by hand with one placeholder left in: production settings refuse it,
    naming the variable the app reads, without repeating the placeholder."""
    example = _example_env()[example_variable]
    dotenv = {**quick_start_env(), example_variable: example}
    done = _start_web_settings(dotenv, "import django; django.setup()")
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"django.core.exceptions.ImproperlyConfigured: {refused_variable}")
    secret = example.partition(":")[2] if example_variable == "FLOWER_BASIC_AUTH" else example
    assert secret not in message


# --- compose wiring an operator meets first ----------------------------------------------------


def test_the_web_answers_prometheus_at_web_8000_under_the_compose_environment() -> None:
    """Prometheus scrapes web:8000, so that is the Host header; production settings with the
    environment compose gives the web (quick-start .env) must accept it, and still refuse an
    unknown Host. Django's test client, the production settings module."""
    probe = (
        "import django; django.setup()\n"
        "from django.test import Client\n"
        "c = Client()\n"
        "for host in ('web:8000', 'localhost:8000', 'evil.example'):\n"
        "    print(host, c.get('/healthz', HTTP_HOST=host).status_code,"
        " c.get('/metrics', HTTP_HOST=host).status_code)\n"
    )
    done = _start_web_settings(quick_start_env(), probe)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    # /metrics without the token: 401 means the Host passed and the token check answered.
    assert answers["web:8000"] == "200 401", done.stdout + done.stderr[-1500:]
    assert answers["localhost:8000"] == "200 401"
    assert answers["evil.example"] == "400 400"


def test_an_operators_own_allowed_hosts_keep_web() -> None:
    done = _start_web_settings(
        {**quick_start_env(), "ALLOWED_HOSTS": "reservations.example.com"},
        "import django; django.setup(); from django.conf import settings as s; "
        "print(','.join(s.ALLOWED_HOSTS))",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "web,reservations.example.com"


def test_every_setting_in_dotenv_reaches_the_app_services() -> None:
    """The documented settings set in .env take effect (compose used to pass only the ~20 it
    named): every app service reads .env whole."""
    services = compose()["services"]
    for name in ("migrate", "web", "worker", "beat", "flower"):
        assert services[name].get("env_file") == ".env", name
    dotenv = {
        **quick_start_env(),
        "CLEANUP_MAX_QUEUE_DEPTH": "1234",
        "METRICS_ALLOW_IPS": "10.9.0.0/16",
        "CLEANUP_CAPACITY_PER_CONSUMER_PER_S": "42",
    }
    probe = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.CLEANUP_MAX_QUEUE_DEPTH, s.METRICS_ALLOW_IPS, "
        "s.CLEANUP_CAPACITY_PER_CONSUMER_PER_S)"
    )
    done = _start_web_settings(dotenv, probe)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1234", "['10.9.0.0/16']", "42.0"]


def test_docker_compose_itself_passes_dotenv_to_the_app() -> None:
    """The same through Debian's docker-compose (its normalized config), when it is installed
    (scripts/test.sh installs it in CI before pytest)."""
    import shutil
    import subprocess
    import tempfile

    if not shutil.which("docker-compose"):
        skip_for_missing("docker-compose", "not installed (scripts/test.sh installs it in CI)")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(ROOT / "docker-compose.yml", tmp)
        dotenv = (ROOT / ".env.example").read_text() + "CLEANUP_MAX_QUEUE_DEPTH=1234\n"
        Path(tmp, ".env").write_text(dotenv)
        done = subprocess.run(
            ["docker-compose", "config"], cwd=tmp, capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    for name in ("migrate", "web", "worker", "beat", "flower"):
        env = services[name]["environment"]
        assert env["CLEANUP_MAX_QUEUE_DEPTH"] == "1234", name
        assert env["ALLOWED_HOSTS"].split(",")[0] == "web", name
        assert env["DJANGO_SETTINGS_MODULE"] == "config.settings.production", name


def test_the_deploy_guide_says_how_to_create_the_first_admin_user() -> None:
    guide = (ROOT / "docs" / "DEPLOY.md").read_text()
    deploy = guide.split("\n## Docker Compose (one host)\n", 1)[1].split("\n## ", 1)[0]
    assert "docker compose exec web python manage.py createsuperuser" in deploy
    assert "DJANGO_SUPERUSER_PASSWORD" in deploy and "--noinput" in deploy


def test_flower_forgets_workers_that_went_offline() -> None:
    flower = command(compose()["services"]["flower"])
    assert "--persistent=True" in flower
    assert re.search(r"--purge_offline_workers=\d+", flower), flower


# Flower holds every task it hears of in memory up to --max_tasks (its default: 100,000, at
# about 7 KiB each as bench/soak.py measures it, some 700 MiB); every shipped Flower keeps at
# most this many.
FLOWER_MAX_TASKS = 10000


def test_every_shipped_flower_keeps_a_bounded_number_of_tasks_in_memory() -> None:
    k8s_flower = next(
        doc
        for doc in k8s_documents()
        if doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith("flower")
    )
    (container,) = k8s_flower["spec"]["template"]["spec"]["containers"]
    run_py = (ROOT / "scripts" / "run.py").read_text()
    shipped = {
        "docker-compose.yml": command(compose()["services"]["flower"]),
        "deploy/k8s/flower.yaml": " ".join(container["args"]),
        "scripts/run.py": run_py.split("def flower_argv", 1)[1].split("\ndef ", 1)[0],
    }
    for where, args in shipped.items():
        found = re.search(r"--max_tasks=(\d+)", args)
        assert found, f"{where}: Flower without --max_tasks keeps 100,000 tasks"
        assert 0 < int(found.group(1)) <= FLOWER_MAX_TASKS, where


def test_alerts_go_to_an_alertmanager_service() -> None:
    services = compose()["services"]
    manager = services["alertmanager"]
    assert "deploy/alertmanager.yml" in " ".join(manager["volumes"])
    assert "alertmanager" in services["prometheus"]["depends_on"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [
        t for a in config["alerting"]["alertmanagers"] for s in a["static_configs"]
        for t in s["targets"]
    ]  # fmt: skip
    assert targets == ["alertmanager:9093"]
    routes = yaml.safe_load((ROOT / "deploy" / "alertmanager.yml").read_text())["route"]
    assert any(r["matchers"] == ['severity="critical"'] for r in routes["routes"])


def _alert_rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "reservation-cleanup.json").read_text()
    )
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_one_slo_setting_drives_the_rules_and_the_dashboard() -> None:
    """No SLO number in the rules or panels: both compare with the gauge the web exports from
    CLEANUP_SLO_SECONDS (cleanup/operations/console/test_gauges.py checks the gauge's value)."""
    slo = _alert_rules()["ReservationCleanupSLOBreach"]["expr"]
    assert "reservation_cleanup_slo_seconds" in slo
    assert not re.search(r"\b\d{2,}\b", slo), slo
    exprs = _dashboard_exprs()
    assert sum("reservation_cleanup_slo_seconds" in e for e in exprs) >= 2
    text = (ROOT / "deploy" / "grafana" / "dashboards" / "reservation-cleanup.json").read_text()
    assert "300" not in text
    assert (
        "reservation_cleanup_slo_seconds"
        in _alert_rules()["ReservationCleanupSLOSignalAbsent"]["expr"]
    )


def test_no_rule_or_panel_depends_on_a_scrape_job_name() -> None:
    """Kubernetes (or any other Prometheus) names its jobs differently: rules and panels select
    by metric name or by the `component` target label that every scrape config sets."""
    for name, rule in _alert_rules().items():
        assert "job=" not in rule["expr"], name
    for expr in _dashboard_exprs():
        assert "job=" not in expr, expr
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    components = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            components.add(static["labels"]["component"])
        for relabel in job.get("relabel_configs", []):
            if relabel.get("target_label") == "component":
                components.add(relabel["replacement"])
    assert components == {"web", "worker", "flower"}
    assert _alert_rules()["ReservationCleanupWebDown"]["expr"].startswith('up{component="web"}')


def test_consumers_are_compared_with_desired_consumers_in_the_same_unit() -> None:
    """desired_consumers counts pool processes; the panel sets the running pool processes
    against it (it used to count worker instances), and no consumer pages on the same gauge."""
    panel = [e for e in _dashboard_exprs() if "desired_consumers" in e]
    assert panel
    exprs = _dashboard_exprs()
    assert "sum(reservation_cleanup_worker_pool_processes)" in exprs
    assert not any(e.startswith("sum(up") for e in exprs)
    rule = _alert_rules()["ReservationCleanupNoConsumers"]["expr"]
    assert "reservation_cleanup_worker_pool_processes" in rule


def test_scrape_errors_are_counted_per_scrape_not_per_process() -> None:
    rule = _alert_rules()["ReservationCleanupScrapeErrors"]["expr"]
    assert "scrape_failed" in rule and "increase(" not in rule
    for expr in _dashboard_exprs():
        assert "scrape_errors_total" not in expr, expr


def _dashboard() -> dict[str, Any]:
    path = ROOT / "deploy" / "grafana" / "dashboards" / "reservation-cleanup.json"
    return dict(json.loads(path.read_text()))


def _dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in _dashboard()["panels"] for t in p.get("targets", [])]


def test_the_dashboard_imports_into_any_grafana() -> None:
    """No data source uid of one installation: every panel and query use the `datasource`
    variable; shard and queue variables filter the panels; links lead to the admin's health
    page and the runbook; rate windows follow Grafana's $__rate_interval."""
    from django.urls import reverse

    dashboard = _dashboard()
    text = json.dumps(dashboard)
    variable = {"type": "prometheus", "uid": "${datasource}"}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name, metric in (
        ("shard", "reservation_cleanup_oldest_eligible_reservation_age_seconds"),
        ("queue", "reservation_cleanup_queue_depth"),
    ):
        assert variables[name]["query"]["query"] == f"label_values({metric}, {name})"
        assert variables[name]["datasource"] == variable
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    uids = set(re.findall(r'"uid": "([^"]+)"', text)) - {dashboard["uid"]}
    assert uids == {"${datasource}"}, uids
    for panel in dashboard["panels"]:
        assert panel["datasource"] == variable, panel["title"]
    for title, target in _dashboard_targets():
        assert target["datasource"] == variable, title
        expr = target["expr"]
        windows = set(re.findall(r"\[([^\]]+)\]", expr))
        assert windows <= {"$__rate_interval"}, (title, expr)
        for label in ("shard", "queue"):
            if "{{" + label + "}}" in target.get("legendFormat", ""):
                assert f'{label}=~"${label}"' in expr, (title, expr)
    links = {link["url"] for link in dashboard["links"]}
    base = "${app_url}"
    assert links == {base + reverse("cleanup-health"), base + reverse("cleanup-runbook")}
    assert variables["app_url"]["type"] == "textbox"


def test_every_panel_query_names_exported_families_and_parses(tmp_path: Path) -> None:
    """Each query on its own (not the file as a whole) names only metric families the code
    exports, and promtool parses it with the variables as Grafana fills them in."""
    import shutil
    import subprocess

    from tests.support.prodstack import grafana_interpolate

    exported = exported_metrics()
    rules = []
    for i, (title, target) in enumerate(_dashboard_targets()):
        names = set(METRIC.findall(target["expr"]))
        assert names, (title, target["expr"])
        assert sorted(names - exported) == [], title
        expr = grafana_interpolate(target["expr"])
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    assert not any("$" in r["expr"] for r in rules), "a variable Grafana would fill is left"
    if not shutil.which("promtool"):
        skip_for_missing("promtool", "Debian package prometheus")
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def test_the_panels_cover_every_counter_the_runbook_sends_the_on_call_to() -> None:
    exprs = " ".join(t["expr"] for _, t in _dashboard_targets())
    for family in (
        "reservation_cleanup_control_messages_dropped_total",
        "reservation_cleanup_broker_entries_skipped_total",
        "reservation_cleanup_backpressure_pauses_total",
        "reservation_cleanup_dead_letters_total",
        "reservation_cleanup_retries_total",
        "reservation_cleanup_releases_paused_seconds",
    ):
        assert family in exprs, family
    # the web's gauges are the same on every replica: aggregated with max, never summed
    for gauge in ("dead_letters_open", "queue_depth", "oldest_eligible_reservation_age_seconds"):
        assert f"sum(reservation_cleanup_{gauge}" not in exprs.replace("sum by", "sumby")
        assert re.search(rf"max(?: by \(\w+\))? \(reservation_cleanup_{gauge}\b", exprs), gauge


# --- Kubernetes manifests ---------------------------------------------------------------------


def _deployments() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_documents() if d["kind"] == "Deployment"}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


OPERATOR_SCHEMAS = {
    "PodMonitor": "prometheus-operator-podmonitor.schema.json",
    "PrometheusRule": "prometheus-operator-prometheusrule.schema.json",
}


def _schema(name: str) -> dict[str, Any]:
    return dict(json.loads((ROOT / "tests" / "unit" / "project" / "schemas" / name).read_text()))


def test_the_manifests_validate_against_the_kubernetes_and_keda_schemas() -> None:
    """Offline: kubernetes-validate's API schemas (strict: unknown fields refused) for every
    built-in kind, the alternatives included; the ScaledObject against the schema in
    tests/unit/project/schemas (its HPA behavior part against the HPA's own API schema)."""
    import jsonschema
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    kinds = []
    for doc in k8s_documents("**/*.yaml"):
        kinds.append(doc["kind"])
        if doc["kind"] in OPERATOR_SCHEMAS:
            jsonschema.validate(doc, _schema(OPERATOR_SCHEMAS[doc["kind"]]))
        elif doc["kind"] == "ScaledObject":
            schema = json.loads(
                (ROOT / "tests/unit/project/schemas/keda-scaledobject.schema.json").read_text()
            )
            jsonschema.validate(doc, schema)
            behavior = doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
            hpa = {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": "keda-hpa-behavior"},
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                    "maxReplicas": doc["spec"]["maxReplicaCount"],
                    "behavior": behavior,
                },
            }
            kubernetes_validate.validate(hpa, version, strict=True)
        else:
            kubernetes_validate.validate(doc, version, strict=True)
    assert {
        "Deployment", "ScaledObject", "NetworkPolicy", "Service", "ConfigMap", "Job",
        "PodDisruptionBudget", "PodMonitor", "PrometheusRule",
    } <= set(kinds)  # fmt: skip


def test_the_schema_check_refuses_a_broken_manifest() -> None:
    import jsonschema
    import kubernetes_validate

    worker = _deployments()["reservation-cleanup-worker"]
    broken = json.loads(json.dumps(worker))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    scaled = next(d for d in k8s_documents() if d["kind"] == "ScaledObject")
    unquoted = json.loads(json.dumps(scaled))
    unquoted["spec"]["triggers"][0]["metadata"]["threshold"] = 8  # KEDA takes strings only
    schema = json.loads(
        (ROOT / "tests/unit/project/schemas/keda-scaledobject.schema.json").read_text()
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(unquoted, schema)


def test_kubectl_apply_of_the_directory_applies_one_autoscaler_and_no_replica_count() -> None:
    applied = k8s_documents()
    autoscalers = [d for d in applied if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    assert [d["kind"] for d in autoscalers] == ["ScaledObject"]
    target = autoscalers[0]["spec"]["scaleTargetRef"]["name"]
    assert "replicas" not in _deployments()[target]["spec"]
    alternatives = k8s_documents("alternatives/*.yaml")
    assert [d["kind"] for d in alternatives] == ["HorizontalPodAutoscaler"]
    assert alternatives[0]["spec"]["scaleTargetRef"]["name"] == target


def _autoscale_bounds(deployment: dict[str, Any]) -> tuple[int, int]:
    arg = next(a for a in _container(deployment)["args"] if a.startswith("--autoscale="))
    high, low = arg.split("=", 1)[1].split(",")
    return int(high), int(low)


def test_the_scaling_thresholds_are_the_ones_docs_autoscaling_describes() -> None:
    """Pods are added for what pools at their --autoscale maximum cannot give, and the age
    trigger is half the SLO of the ConfigMap."""
    scaled = next(d for d in k8s_documents() if d["kind"] == "ScaledObject")
    triggers = {t["name"]: t["metadata"] for t in scaled["spec"]["triggers"]}
    worker = _deployments()[scaled["spec"]["scaleTargetRef"]["name"]]
    high, _ = _autoscale_bounds(worker)
    assert float(triggers["desired-consumers"]["threshold"]) == high
    config = next(
        d
        for d in k8s_documents()
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "reservation-cleanup"
    )
    slo = int(config["data"]["CLEANUP_SLO_SECONDS"])
    assert float(triggers["oldest-eligible-age"]["threshold"]) == slo / 2
    hpa = k8s_documents("alternatives/*.yaml")[0]
    targets = {
        m["external"]["metric"]["name"]: m["external"]["target"] for m in hpa["spec"]["metrics"]
    }
    assert float(targets["reservation_cleanup_desired_consumers"]["averageValue"]) == high
    docs = (ROOT / "docs" / "AUTOSCALING.md").read_text()
    assert f"ceil(value / {high} consumers per pod)" in docs


def test_every_pod_runs_restricted() -> None:
    for name, deployment in _deployments().items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        container = _container(deployment)["securityContext"]
        assert container["allowPrivilegeEscalation"] is False, name
        assert container["readOnlyRootFilesystem"] is True, name
        assert container["capabilities"]["drop"] == ["ALL"], name
        mounts = {m["mountPath"] for m in _container(deployment).get("volumeMounts", [])}
        assert "/tmp" in mounts, f"{name}: a read-only root needs a writable /tmp"


def test_the_worker_liveness_does_not_go_through_the_broker() -> None:
    probe = _container(_deployments()["reservation-cleanup-worker"])["livenessProbe"]
    assert "exec" not in probe, probe  # manage.py worker_health pings through the broker
    assert probe["httpGet"]["port"] == "metrics"


def test_only_prometheus_reaches_the_worker_metrics_port() -> None:
    policies = [d for d in k8s_documents() if d["kind"] == "NetworkPolicy"]
    worker = _deployments()["reservation-cleanup-worker"]
    labels = worker["spec"]["template"]["metadata"]["labels"]
    policy = next(p for p in policies if p["spec"]["podSelector"]["matchLabels"] == labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [9808]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}


def test_the_web_is_deployed_and_scraped_with_the_component_label() -> None:
    web = _deployments()["reservation-cleanup-web"]
    container = _container(web)
    assert container["args"][:2] == ["gunicorn", "config.wsgi:application"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env = {e["name"]: e for e in container["env"]}
    # kubelet's probes and the pod scrape send the pod IP as Host
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "$(POD_IP)" in env["ALLOWED_HOSTS"]["value"].split(",")
    scrape = next(
        d
        for d in k8s_documents("*.yaml")
        if d["kind"] == "ConfigMap" and "scrape-configs.yaml" in d["data"]
    )
    jobs = yaml.safe_load(scrape["data"]["scrape-configs.yaml"])
    components = {
        r["replacement"] for job in jobs for r in job["relabel_configs"]
        if r.get("target_label") == "component"
    }  # fmt: skip
    assert components == {"web", "worker"}
    web_job = next(j for j in jobs if "web" in j["job_name"])
    assert "credentials_file" in web_job["authorization"]


def test_the_connection_budget_is_written_down_with_the_manifests_numbers() -> None:
    """Pools times replicas against PostgreSQL's max_connections: the numbers in worker.yaml's
    note are the manifests' own."""
    scaled = next(d for d in k8s_documents() if d["kind"] == "ScaledObject")
    worker = _deployments()["reservation-cleanup-worker"]
    web = _deployments()["reservation-cleanup-web"]
    high, _ = _autoscale_bounds(worker)
    per_pod = high + 1
    workers = per_pod * scaled["spec"]["maxReplicaCount"]
    gunicorn = int(
        next(a for a in _container(web)["args"] if a.startswith("--workers=")).split("=")[1]
    )
    webs = web["spec"]["replicas"] * gunicorn
    beat_replicas = _deployments()["reservation-cleanup-beat"]["spec"]["replicas"]
    beats = beat_replicas * 2  # each beat: its lease's own connection and Django's
    total = workers + webs + beats + 1  # and Flower
    note = (ROOT / "deploy" / "k8s" / "worker.yaml").read_text()
    assert f"up to {workers}" in note and f"= {webs})" in note and f"= {beats})" in note
    assert f": {total}." in note, total
    assert "max_connections is 100" in note
    assert "Connection budget" in (ROOT / "docs" / "AUTOSCALING.md").read_text()


# --- the Kubernetes set complete: kustomize, migrations, beat, Flower, PDBs, probes -----------


def _pod_specs() -> dict[str, dict[str, Any]]:
    """Every pod template `kubectl apply -k deploy/k8s/` creates, by owner name."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in k8s_documents()
        if d["kind"] in ("Deployment", "Job")
    }


def _project_version() -> str:
    import tomllib

    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_the_kustomization_pins_every_image_in_one_place() -> None:
    """The manifests name the image without a tag; kustomization.yaml sets it (the project's
    version), so nothing runs an unpinned :latest and a deploy changes the tag in one line."""
    kustomization = _kustomization(K8S)
    (image,) = kustomization["images"]
    assert image["name"] == "reservation-cleanup"
    assert image.get("digest") or image["newTag"] == _project_version()
    assert ":latest" not in "".join(p.read_text() for p in K8S.rglob("*.yaml"))
    for doc in k8s_documents("*.yaml"):
        for container in _containers_of(doc):
            assert container["image"] == "reservation-cleanup", (doc["metadata"]["name"], container)
    pinned = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for name, pod in _pod_specs().items():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            assert container["image"] == pinned, (name, container["name"])
    # every manifest of the directory is in the kustomization or documented as applied apart
    listed = set(kustomization["resources"])
    apart = {"prometheus-scrape.yaml"}
    assert {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} == listed | apart
    assert sorted(_kustomization(K8S / "prometheus-operator")["resources"]) == [
        "podmonitors.yaml",
        "prometheusrule.yaml",
    ]


def _containers_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] not in ("Deployment", "Job"):
        return []
    pod = doc["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_kubectl_kustomize_renders_the_same_resources_the_tests_read() -> None:
    """The tests read the kustomization with a small Python rendering (resources, images);
    where kubectl is installed, its own kustomize must agree with it."""
    import shutil
    import subprocess

    if not shutil.which("kubectl"):
        skip_for_missing("kubectl", "its kustomize checks the Python rendering the tests read")
    for directory, ours in ((K8S, k8s_documents()), (K8S / "prometheus-operator", None)):
        done = subprocess.run(
            ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        theirs = [d for d in yaml.safe_load_all(done.stdout) if d]
        if ours is None:
            ours = [
                d
                for name in _kustomization(directory)["resources"]
                for d in yaml.safe_load_all((directory / name).read_text())
                if d
            ]
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        assert sorted(map(key, theirs)) == sorted(map(key, ours))
        by_key = {key(d): d for d in ours}
        for doc in theirs:
            mine = by_key[key(doc)]
            # kustomize's `labels` adds part-of to metadata only; everything else is identical
            doc["metadata"].get("labels", {}).pop("app.kubernetes.io/part-of", None)
            assert doc == mine, key(doc)


def test_the_app_starts_only_after_the_migrations_job() -> None:
    jobs = [d for d in k8s_documents() if d["kind"] == "Job"]
    (job,) = jobs
    script = " ".join(job["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "manage.py migrate --noinput" in script and "install_cleanup_schedule" in script
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    # a Job's pod template is immutable: it must go away so the next deploy can create it anew
    assert 0 < job["spec"]["ttlSecondsAfterFinished"] <= 3600
    for name, pod in _pod_specs().items():
        if name == job["metadata"]["name"]:
            continue
        (wait,) = pod["initContainers"]
        assert "manage.py migrate --check" in " ".join(wait["command"]), name
        assert wait["envFrom"] == _container({"spec": {"template": {"spec": pod}}})["envFrom"]


def test_beat_runs_two_replicas_behind_the_leader_lease() -> None:
    from cleanup.celery import app

    beat = _deployments()["reservation-cleanup-beat"]
    assert beat["spec"]["replicas"] == 2
    container = _container(beat)
    assert container["args"][:4] == ["celery", "-A", "config", "beat"]
    # only the holder of the PostgreSQL lease sends: a second replica is a standby
    assert app.conf.beat_scheduler.endswith("LeaderDatabaseScheduler")
    for probe in ("livenessProbe", "startupProbe"):
        assert container[probe]["exec"]["command"] == ["python", "manage.py", "beat_health"]
    # beat_health answers within its own statement budget; the probe gives it room
    assert container["livenessProbe"]["timeoutSeconds"] >= 10


def test_every_long_running_container_has_a_startup_probe_before_its_liveness() -> None:
    for name, deployment in _deployments().items():
        container = _container(deployment)
        assert "startupProbe" in container, name
        assert "livenessProbe" in container, name
        # the startup probe replaces an initial delay: liveness counts from the first answer
        assert "initialDelaySeconds" not in container["livenessProbe"], name
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 60, name


def test_disruption_budgets_keep_web_workers_and_beat_serving_through_a_drain() -> None:
    budgets = [d for d in k8s_documents() if d["kind"] == "PodDisruptionBudget"]
    deployments = _deployments()
    covered = set()
    for budget in budgets:
        selector = budget["spec"]["selector"]["matchLabels"]
        (target,) = [
            name
            for name, d in deployments.items()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        covered.add(target)
        assert budget["spec"].get("maxUnavailable") == 1, budget["metadata"]["name"]
    assert covered == {
        "reservation-cleanup-web",
        "reservation-cleanup-worker",
        "reservation-cleanup-beat",
    }


def test_every_pod_of_the_kustomization_runs_restricted() -> None:
    """Init containers and the migrations Job too (the restricted Pod Security Standard applies
    to every container of a pod)."""
    for name, pod in _pod_specs().items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert context["capabilities"]["drop"] == ["ALL"], (name, container["name"])


def test_keda_falls_back_when_prometheus_is_gone_and_sets_no_cooldown_it_would_ignore() -> None:
    scaled = next(d for d in k8s_documents() if d["kind"] == "ScaledObject")
    spec = scaled["spec"]
    fallback = spec["fallback"]
    assert fallback["failureThreshold"] >= 1
    assert spec["minReplicaCount"] <= fallback["replicas"] <= spec["maxReplicaCount"]
    # KEDA refuses a fallback next to a Value trigger (it applies only to AverageValue ones)
    assert {t["metricType"] for t in spec["triggers"]} == {"AverageValue"}
    # cooldownPeriod only paces scaling to zero; the HPA's behavior paces everything above it
    if spec["minReplicaCount"] > 0:
        assert "cooldownPeriod" not in spec
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60


def _flower_options(argv: list[str]) -> dict[str, Any]:
    """The options the pinned Flower parses from ``argv`` (what follows `celery … flower`), as
    its own command does, in a fresh interpreter (tornado's options are process-global)."""
    import subprocess
    import sys

    probe = (
        "import json, sys\n"
        "from flower.command import apply_options\n"
        "from flower.options import options\n"
        "apply_options('flower', sys.argv[1:])\n"
        "print(json.dumps({'read_only': options.read_only, 'port': options.port}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _after_flower(argv: list[str]) -> list[str]:
    return argv[argv.index("flower") + 1 :]


def test_flower_runs_read_only_everywhere_it_is_started() -> None:
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location("run", ROOT / "scripts" / "run.py")
        assert spec and spec.loader
        run = importlib.util.module_from_spec(spec)
        sys.modules["run"] = run  # its dataclasses look their module up
        spec.loader.exec_module(run)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
        sys.modules.pop("run", None)
    k8s_flower = _container(_deployments()["reservation-cleanup-flower"])
    started = {
        "compose": compose()["services"]["flower"]["command"],
        "scripts/run.py": run.flower_argv(5555),
        "deploy/k8s": k8s_flower["args"],
    }
    for where, argv in started.items():
        assert _flower_options(_after_flower(argv))["read_only"] is True, where
    assert _flower_options(["--port=5555"])["read_only"] is False  # the probe can tell
    # authenticated: basic auth from the Secret (FLOWER_BASIC_AUTH), never on the command line
    assert {"secretRef": {"name": "reservation-cleanup"}} in k8s_flower["envFrom"]
    assert "FLOWER_BASIC_AUTH" in (K8S / "worker.yaml").read_text()
    for argv in started.values():
        assert not any("basic_auth" in a for a in argv)


# --- monitoring manifests generated from one source ------------------------------------------


def _monitoring_manifests() -> Any:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "monitoring_manifests", ROOT / "scripts" / "monitoring_manifests.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_the_generated_monitoring_manifests_are_up_to_date() -> None:
    """PrometheusRule, PodMonitors and the plain scrape configuration are rendered from
    deploy/alerts.yml and one table of targets; an edit of either without re-rendering fails
    here (`python scripts/monitoring_manifests.py` fixes it)."""
    module = _monitoring_manifests()
    for path, text in module.rendered().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is out of date"
    assert module.main(["--check"]) == 0


def test_the_prometheus_rule_carries_the_same_rules_as_alerts_yml() -> None:
    rule = next(
        d for d in k8s_documents("prometheus-operator/*.yaml") if d["kind"] == "PrometheusRule"
    )
    module = _monitoring_manifests()
    ours = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())["groups"]
    theirs = json.loads(
        json.dumps(rule["spec"]["groups"])
        .replace(module.WEB_URL, module.COMPOSE_WEB_URL)
        .replace(module.GRAFANA_URL, module.COMPOSE_GRAFANA_URL)
    )
    assert theirs == ours
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert all(r["annotations"]["runbook_url"].startswith(module.WEB_URL) for r in rules)


def test_promtool_accepts_the_rules_the_kubernetes_files_carry(tmp_path: Path) -> None:
    import shutil
    import subprocess

    if not shutil.which("promtool"):
        skip_for_missing("promtool", "Debian package prometheus")
    rule = next(
        d for d in k8s_documents("prometheus-operator/*.yaml") if d["kind"] == "PrometheusRule"
    )
    plain = next(
        d for d in k8s_documents("*.yaml") if d["metadata"]["name"].endswith("prometheus-rules")
    )
    files = {
        "operator.yml": yaml.safe_dump({"groups": rule["spec"]["groups"]}),
        "plain.yml": plain["data"]["alerts.yml"],
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        done = subprocess.run(
            ["promtool", "check", "rules", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"SUCCESS: {len(_alert_rules())} rules found" in done.stdout


def test_the_pod_monitors_select_the_pods_and_ports_the_deployments_have() -> None:
    monitors = [d for d in k8s_documents("prometheus-operator/*.yaml") if d["kind"] == "PodMonitor"]
    deployments = _deployments()
    components = set()
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        (target,) = [
            d
            for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        ports = {p["name"] for p in _container(target).get("ports", [])}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports, monitor["metadata"]["name"]
            (relabel,) = [r for r in endpoint["relabelings"] if r["targetLabel"] == "component"]
            components.add(relabel["replacement"])
            if "authorization" in endpoint:
                secret = endpoint["authorization"]["credentials"]
                assert {"secretRef": {"name": secret["name"]}} in _container(target)["envFrom"]
                assert secret["key"] == "METRICS_TOKEN"
    # the components the rules select (web's SLO signal, the workers' pool gauge)
    assert components == {"web", "worker"}
    web = next(m for m in monitors if m["metadata"]["name"].endswith("-web"))
    assert "authorization" in web["spec"]["podMetricsEndpoints"][0]


# --- alerts the on-call can route and follow -------------------------------------------------


def test_every_alert_has_a_standard_severity_and_the_annotations_tools_show() -> None:
    runbook = (ROOT / "cleanup" / "operations" / "console" / "RUNBOOK.md").read_text()
    from cleanup.operations.console.runbook import anchor

    sections = {anchor(line[3:]) for line in runbook.splitlines() if line.startswith("## ")}
    for name, rule in _alert_rules().items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url", "dashboard_url"}, name
        url, _, fragment = annotations["runbook_url"].partition("#")
        assert url.endswith("/admin/cleanup/runbook/"), name
        assert fragment == anchor(name) and fragment in sections, name
        assert "/d/reservation-cleanup/" in annotations["dashboard_url"], name
        section = runbook.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "**First three checks**" in section and "**Fix**" in section, name
        assert "docker compose" in section and "kubectl" in section, name
    assert len(sections) == len(_alert_rules())


def test_the_known_label_values_cover_every_drop_reason_and_reader_in_the_code() -> None:
    """The drop and skip counters are created at 0 with these labels; a reason or reader added
    in the code without them would have no series to alert from until it first happens."""
    from cleanup import metrics

    code = "".join(p.read_text() for p in (ROOT / "cleanup").rglob("*.py"))
    drops = set(re.findall(r'record_(?:control_)?drop\("(\w+)"', code))
    drops |= set(
        re.findall(r'return "(\w+)", f?"', (ROOT / "cleanup/worker/remote_control.py").read_text())
    )
    readers = set(re.findall(r'(?:_skipped|record_skipped_entry)\("(\w+)"', code))
    assert drops and readers
    assert drops == set(metrics.KNOWN_CONTROL_DROP_REASONS)
    assert readers == set(metrics.KNOWN_SKIP_READERS)
    metrics.initialize_worker_series()
    created = {
        s.labels.get("reason") or s.labels.get("reader")
        for family in [*metrics.CONTROL_DROPS.collect(), *metrics.BROKER_ENTRIES_SKIPPED.collect()]
        for s in family.samples
    }
    assert created >= drops | readers


# --- the pooled variant: PgBouncer in transaction pooling, opt in ------------------------------

POOLED_SERVICES = ("web", "worker", "beat", "flower")
POOLED_COMPOSE = ROOT / "docker-compose.pgbouncer.yml"
POOLED_K8S = ROOT / "deploy" / "k8s-pgbouncer"


def _merged_compose_env(
    dotenv: dict[str, str], override_file: Path = POOLED_COMPOSE
) -> dict[str, dict[str, str]]:
    """Each service's `environment` after docker-compose.yml and an override file (the pooled
    one unless told), as compose merges them (the override's mapping wins per name),
    interpolated with ``dotenv``."""
    base = compose()["services"]
    override = yaml.safe_load(override_file.read_text())["services"]
    merged: dict[str, dict[str, str]] = {}
    for name in set(base) | set(override):
        env = {**base.get(name, {}).get("environment", {})}
        env.update(override.get(name, {}).get("environment", {}))
        merged[name] = {k: _interpolate(str(v), dotenv) for k, v in env.items()}
    return merged


def test_the_pooled_compose_variant_sets_the_three_database_variables_consistently() -> None:
    from config.env import parse_database_url

    envs = _merged_compose_env(quick_start_env())
    plain = compose()["services"]
    for name in POOLED_SERVICES:
        env = envs[name]
        assert env["DATABASE_POOLING"] == "transaction", name
        pooled = parse_database_url("DATABASE_URL", env["DATABASE_URL"])
        direct = parse_database_url("DATABASE_DIRECT_URL", env["DATABASE_DIRECT_URL"])
        assert (pooled["HOST"], pooled["PORT"]) == ("pgbouncer", "6432"), name
        assert (direct["HOST"], direct["PORT"]) == ("postgres", "5432"), name
        # the same user, password and database both ways; the rest of the app's settings kept
        for key in ("NAME", "USER", "PASSWORD"):
            assert pooled[key] == direct[key], (name, key)
        assert env["SECRET_KEY"] and env["DJANGO_SETTINGS_MODULE"], name
        assert (
            "pgbouncer"
            in yaml.safe_load(POOLED_COMPOSE.read_text())["services"][name]["depends_on"]
        )
        assert "DATABASE_POOLING" not in plain[name]["environment"], name
    # migrate stays direct, without pooling; PgBouncer pools transactions before the same server
    assert "@postgres:5432/" in envs["migrate"]["DATABASE_URL"]
    assert "DATABASE_POOLING" not in envs["migrate"]
    bouncer = envs["pgbouncer"]
    assert bouncer["PGBOUNCER_POOL_MODE"] == "transaction"
    assert bouncer["POSTGRESQL_HOST"] == "postgres"
    assert bouncer["PGBOUNCER_DATABASE"] == direct["NAME"]
    assert bouncer["POSTGRESQL_USERNAME"] == direct["USER"]
    image = yaml.safe_load(POOLED_COMPOSE.read_text())["services"]["pgbouncer"]["image"]
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+", image), image  # a pinned tag


def test_the_pooled_compose_variant_loads_under_the_production_settings() -> None:
    """The web's environment of the pooled variant passes config.settings.production: the three
    variables agree (a missing DATABASE_DIRECT_URL or prepared statements would be refused)."""
    import os
    import subprocess
    import sys

    dotenv = quick_start_env()
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    env.update(dotenv)
    env.update(_merged_compose_env(dotenv)["web"])
    probe = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.DATABASE_POOLING, s.DATABASES['default']['HOST'], "
        "s.DATABASES['locks']['HOST'], s.DATABASE_PREPARED_STATEMENTS)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["transaction", "pgbouncer", "postgres", "False"]


def _compose_config(override: Path, *directories: str) -> dict[str, Any]:
    """The services `docker-compose config` makes of docker-compose.yml with ``override`` (and
    the repository's ``directories`` it mounts), .env.example as the .env."""
    import shutil
    import subprocess
    import tempfile

    if not shutil.which("docker-compose"):
        skip_for_missing("docker-compose", "not installed (scripts/test.sh installs it in CI)")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(ROOT / "docker-compose.yml", tmp)
        shutil.copy(override, tmp)
        for directory in directories:
            shutil.copytree(ROOT / directory, Path(tmp, directory))
        shutil.copy(ROOT / ".env.example", Path(tmp, ".env"))
        done = subprocess.run(
            ["docker-compose", "-f", "docker-compose.yml", "-f", override.name, "config"],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    services: dict[str, Any] = yaml.safe_load(done.stdout)["services"]
    return services


def test_docker_compose_accepts_the_pooled_variant() -> None:
    services = _compose_config(POOLED_COMPOSE)
    for name in POOLED_SERVICES:
        env = services[name]["environment"]
        assert env["DATABASE_POOLING"] == "transaction", name
        assert "@pgbouncer:6432/" in env["DATABASE_URL"], name
        assert "@postgres:5432/" in env["DATABASE_DIRECT_URL"], name
        assert env["FLOWER_BASIC_AUTH"], name  # the base file's environment is kept


def _pooled_k8s_documents() -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/k8s-pgbouncer/` applies, rendered in Python: the base, the
    overlay's resources, and its patches, which each prepend env entries to one container."""
    kustomization = _kustomization(POOLED_K8S)
    assert kustomization["resources"][0] == "../k8s"
    docs = k8s_documents()
    for name in kustomization["resources"][1:]:
        docs.extend(d for d in yaml.safe_load_all((POOLED_K8S / name).read_text()) if d)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for patch in kustomization["patches"]:
        body = yaml.safe_load(patch["patch"])
        target = by_name[(patch["target"]["kind"], patch["target"]["name"])]
        for wanted in body["spec"]["template"]["spec"]["containers"]:
            (container,) = [
                c
                for c in target["spec"]["template"]["spec"]["containers"]
                if c["name"] == wanted["name"]
            ]
            names = {e["name"] for e in wanted["env"]}
            kept = [e for e in container.get("env", []) if e["name"] not in names]
            container["env"] = [*wanted["env"], *kept]
    return docs


def test_the_pooled_kubernetes_variant_sets_the_three_database_variables_consistently() -> None:
    docs = _pooled_k8s_documents()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    service = next(
        d
        for d in docs
        if d["kind"] == "Service" and d["metadata"]["name"] == "reservation-cleanup-pgbouncer"
    )
    for name in POOLED_SERVICES:
        deployment = deployments[f"reservation-cleanup-{name}"]
        env = {e["name"]: e for e in _container(deployment)["env"]}
        assert env["DATABASE_POOLING"]["value"] == "transaction", name
        pooled = env["DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        direct = env["DATABASE_DIRECT_URL"]["valueFrom"]["secretKeyRef"]
        assert pooled == {"name": "reservation-cleanup", "key": "DATABASE_POOLED_URL"}, name
        assert direct == {"name": "reservation-cleanup", "key": "DATABASE_URL"}, name
        # the init container waiting for the migrations stays direct, without pooling
        for init in deployment["spec"]["template"]["spec"]["initContainers"]:
            assert "env" not in init or "DATABASE_POOLING" not in str(init["env"]), name
    job = next(d for d in docs if d["kind"] == "Job")
    assert "DATABASE_POOLING" not in str(job)
    # the Service the pooled URL names reaches PgBouncer in transaction pooling
    bouncer = _container(deployments["reservation-cleanup-pgbouncer"])
    bouncer_env = {e["name"]: e.get("value") for e in bouncer["env"]}
    assert bouncer_env["PGBOUNCER_POOL_MODE"] == "transaction"
    assert service["spec"]["ports"][0]["port"] == int(bouncer_env["PGBOUNCER_PORT"]) == 6432
    assert (
        service["spec"]["selector"]
        == (deployments["reservation-cleanup-pgbouncer"]["spec"]["selector"]["matchLabels"])
    )
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+", bouncer["image"]), bouncer["image"]
    assert "reservation-cleanup-pgbouncer:6432" in (POOLED_K8S / "kustomization.yaml").read_text()
    # the base itself stays unpooled
    for name in POOLED_SERVICES:
        base = _deployments()[f"reservation-cleanup-{name}"]
        assert "DATABASE_POOLING" not in str(_container(base).get("env", [])), name


def test_the_pooled_kubernetes_variant_validates_and_kustomize_agrees() -> None:
    """The overlay's own manifests against the Kubernetes schemas (strict, offline), and, where
    kubectl is installed, its kustomize renders what the Python rendering above reads."""

    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    for name in _kustomization(POOLED_K8S)["resources"][1:]:
        for doc in yaml.safe_load_all((POOLED_K8S / name).read_text()):
            kubernetes_validate.validate(doc, version, strict=True)
    ours = _pooled_k8s_documents()
    for doc in ours:
        if doc["kind"] == "Deployment":
            kubernetes_validate.validate(doc, version, strict=True)
    _assert_kubectl_renders(POOLED_K8S, ours)


def _assert_kubectl_renders(directory: Path, ours: list[dict[str, Any]]) -> None:
    """Where kubectl is installed, its own kustomize renders ``directory`` as the tests'
    Python rendering ``ours`` does (the part-of label aside)."""
    import shutil
    import subprocess

    if not shutil.which("kubectl"):
        skip_for_missing("kubectl", "its kustomize checks the Python rendering the tests read")
    done = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    theirs = [d for d in yaml.safe_load_all(done.stdout) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, theirs)) == sorted(map(key, ours))
    by_key = {key(d): d for d in ours}
    for doc in theirs:
        doc["metadata"].get("labels", {}).pop("app.kubernetes.io/part-of", None)
        mine = by_key[key(doc)]
        mine["metadata"].get("labels", {}).pop("app.kubernetes.io/part-of", None)
        assert doc == mine, key(doc)


# --- the RabbitMQ cluster variant: three nodes, quorum queues, opt in --------------------------

RABBITMQ_COMPOSE = ROOT / "docker-compose.rabbitmq.yml"
RABBITMQ_K8S = ROOT / "deploy" / "k8s-rabbitmq"
RABBITMQ_NODES = ("rabbitmq1", "rabbitmq2", "rabbitmq3")
# A pinned tag of a RabbitMQ that grows quorum queues as nodes join (3.13 and later).
RABBITMQ_IMAGE = re.compile(r"rabbitmq:(3\.13|4\.\d+)\.\d+(-management)?")


def _rabbitmq_override() -> dict[str, Any]:
    return dict(yaml.safe_load(RABBITMQ_COMPOSE.read_text())["services"])


def _broker_entries(url: str) -> list[Any]:
    from urllib.parse import urlsplit

    return [urlsplit(entry) for entry in url.split(";")]


def test_the_rabbitmq_compose_variant_points_every_broker_reader_at_the_three_nodes() -> None:
    """Every service of docker-compose.yml that reads CELERY_BROKER_URL gets, with the override,
    one failover URL naming the three nodes with the nodes' own user, password and vhost, and
    quorum queues; no service is left on Redis."""
    dotenv = quick_start_env()
    envs = _merged_compose_env(dotenv, RABBITMQ_COMPOSE)
    override = _rabbitmq_override()
    base = compose()["services"]
    readers = [name for name, s in base.items() if "CELERY_BROKER_URL" in s.get("environment", {})]
    assert {"migrate", "web", "worker", "beat", "flower"} <= set(readers)
    node_env = envs["rabbitmq1"]
    for name in readers:
        env = envs[name]
        assert env["CLEANUP_RABBITMQ_QUEUE_TYPE"] == "quorum", name
        assert "redis" not in env["CELERY_BROKER_URL"], name
        entries = _broker_entries(env["CELERY_BROKER_URL"])
        assert [(e.scheme, e.hostname, e.port) for e in entries] == [
            ("amqp", node, 5672) for node in RABBITMQ_NODES
        ], name
        for entry in entries:
            assert entry.username == node_env["RABBITMQ_DEFAULT_USER"], name
            assert (
                entry.password == node_env["RABBITMQ_DEFAULT_PASS"] == dotenv["RABBITMQ_PASSWORD"]
            )
            assert entry.path == "/" + node_env["RABBITMQ_DEFAULT_VHOST"], name
        # the base's other settings are kept
        assert env["SECRET_KEY"] and env["DJANGO_SETTINGS_MODULE"], name
    # the long-running ones start once every node is healthy (migrate sends nothing)
    for name in ("web", "worker", "beat", "flower"):
        deps = override[name]["depends_on"]
        assert {n: deps[n]["condition"] for n in RABBITMQ_NODES} == dict.fromkeys(
            RABBITMQ_NODES, "service_healthy"
        ), name
    # the base itself stays on Redis, without the setting
    for name in readers:
        assert base[name]["environment"]["CELERY_BROKER_URL"].startswith("redis://"), name
        assert "CLEANUP_RABBITMQ_QUEUE_TYPE" not in base[name]["environment"], name


def test_the_rabbitmq_compose_nodes_form_one_cluster() -> None:
    """Three nodes of a pinned official image, each with a fixed hostname and a volume of its
    own, one Erlang cookie and user from .env, a health check, and the cluster configuration
    listing exactly those nodes."""
    override = _rabbitmq_override()
    dotenv = quick_start_env()
    envs = _merged_compose_env(dotenv, RABBITMQ_COMPOSE)
    text = RABBITMQ_COMPOSE.read_text()
    assert "${RABBITMQ_ERLANG_COOKIE:?" in text and "${RABBITMQ_PASSWORD:?" in text
    volumes = set()
    conf_mounts = set()
    for node in RABBITMQ_NODES:
        service = override[node]
        assert RABBITMQ_IMAGE.fullmatch(service["image"]), service["image"]
        assert service["hostname"] == node
        assert "rabbitmq-diagnostics" in healthcheck(service)
        data = [v for v in service["volumes"] if v.endswith(":/var/lib/rabbitmq")]
        assert len(data) == 1, node
        volumes.add(data[0].split(":")[0])
        (conf,) = [v for v in service["volumes"] if "/etc/rabbitmq/" in v]
        conf_mounts.add(conf)
        assert conf.endswith(":ro")
        env = envs[node]
        assert env["RABBITMQ_ERLANG_COOKIE"] == dotenv["RABBITMQ_ERLANG_COOKIE"]
        assert env["RABBITMQ_DEFAULT_VHOST"] == "reservations"
        assert "ports" not in service, node  # only the app containers reach the nodes
    assert len(volumes) == 3
    assert volumes <= set(yaml.safe_load(text)["volumes"])
    (conf,) = conf_mounts
    source = ROOT / conf.split(":")[0]
    settings = dict(
        line.split(" = ", 1)
        for line in source.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert settings["cluster_formation.peer_discovery_backend"] == "classic_config"
    listed = {
        v for k, v in settings.items() if k.startswith("cluster_formation.classic_config.nodes.")
    }
    assert listed == {f"rabbit@{node}" for node in RABBITMQ_NODES}
    assert settings["quorum_queue.continuous_membership_reconciliation.enabled"] == "true"


def test_the_rabbitmq_compose_variant_loads_under_the_production_settings() -> None:
    """The web's environment of the variant passes config.settings.production (a quorum queue
    type with a Redis URL, or an example password, would be refused), with the screened AMQP
    transport and the delivery counters in PostgreSQL."""
    import os
    import subprocess
    import sys

    def start(dotenv: dict[str, str]) -> Any:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
        env.update(dotenv)
        env.update(_merged_compose_env(dotenv, RABBITMQ_COMPOSE)["web"])
        probe = (
            "import django; django.setup(); from django.conf import settings as s; "
            "print(s.BROKER_IS_REDIS, s.CLEANUP_RABBITMQ_QUEUE_TYPE, s.CELERY_BROKER_TRANSPORT, "
            "repr(s.CLEANUP_COUNTER_REDIS_URL), len(s.CELERY_BROKER_URL.split(';')))"
        )
        return subprocess.run(
            [sys.executable, "-c", probe],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    done = start(quick_start_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [
        "False",
        "quorum",
        "cleanup.worker.amqp_transport:Transport",
        "''",
        "3",
    ]
    example = _example_env()["RABBITMQ_PASSWORD"]
    refused = start({**quick_start_env(), "RABBITMQ_PASSWORD": example})
    assert refused.returncode != 0
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith("django.core.exceptions.ImproperlyConfigured: CELERY_BROKER_URL")
    assert example not in message


def test_env_example_lists_every_variable_the_rabbitmq_variant_reads() -> None:
    used = set(COMPOSE_VAR.findall(RABBITMQ_COMPOSE.read_text()))
    example = _example_env()
    assert {"RABBITMQ_PASSWORD", "RABBITMQ_ERLANG_COOKIE"} <= used
    assert sorted(used - set(example)) == []
    # placeholders, so that scripts/make_env.py generates them
    assert "change-me" in example["RABBITMQ_PASSWORD"]
    assert "change-me" in example["RABBITMQ_ERLANG_COOKIE"]


def test_docker_compose_accepts_the_rabbitmq_variant() -> None:
    services = _compose_config(RABBITMQ_COMPOSE, "deploy/rabbitmq")
    for name in ("migrate", "web", "worker", "beat", "flower"):
        env = services[name]["environment"]
        assert env["CLEANUP_RABBITMQ_QUEUE_TYPE"] == "quorum", name
        hosts = [e.hostname for e in _broker_entries(env["CELERY_BROKER_URL"])]
        assert hosts == list(RABBITMQ_NODES), name
        assert env["FLOWER_BASIC_AUTH"], name  # the base file's environment is kept
    for node in RABBITMQ_NODES:
        assert services[node]["hostname"] == node


def _rabbitmq_k8s_documents() -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/k8s-rabbitmq/` applies, rendered in Python: the base, the
    overlay's resources and its patches (env entries prepended to the named containers and
    init containers, ConfigMap data merged, the ScaledObject's JSON patch)."""
    kustomization = _kustomization(RABBITMQ_K8S)
    assert kustomization["resources"][0] == "../k8s"
    docs = k8s_documents()
    for name in kustomization["resources"][1:]:
        docs.extend(d for d in yaml.safe_load_all((RABBITMQ_K8S / name).read_text()) if d)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for patch in kustomization["patches"]:
        body = yaml.safe_load(patch["patch"])
        target = by_name[(patch["target"]["kind"], patch["target"]["name"])]
        if isinstance(body, list):  # JSON 6902: test, then remove
            for op in body:
                *parents, last = op["path"].strip("/").split("/")
                node: Any = target
                for part in parents:
                    node = node[int(part)] if isinstance(node, list) else node[part]
                key: Any = int(last) if isinstance(node, list) else last
                if op["op"] == "test":
                    assert node[key] == op["value"], op
                else:
                    assert op["op"] == "remove", op
                    del node[key]
        elif body["kind"] == "ConfigMap":
            target["data"].update(body["data"])
        else:
            for field in ("initContainers", "containers"):
                for wanted in body["spec"]["template"]["spec"].get(field, []):
                    (container,) = [
                        c
                        for c in target["spec"]["template"]["spec"][field]
                        if c["name"] == wanted["name"]
                    ]
                    names = {e["name"] for e in wanted["env"]}
                    kept = [e for e in container.get("env", []) if e["name"] not in names]
                    container["env"] = [*wanted["env"], *kept]
    return docs


def test_the_rabbitmq_kubernetes_variant_gives_every_container_the_cluster_and_quorum() -> None:
    """Every container that loads the settings (Deployments and the Job, init containers
    included) reads CELERY_BROKER_URL from the Secret's RABBITMQ_BROKER_URL and the ConfigMap
    that sets quorum; the URL the header documents names the operator's three pods."""
    docs = _rabbitmq_k8s_documents()
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config["data"]["CLEANUP_RABBITMQ_QUEUE_TYPE"] == "quorum"
    checked = []
    for doc in docs:
        for container in _containers_of(doc):
            where = (doc["metadata"]["name"], container["name"])
            if container["image"].split(":")[0] != "reservation-cleanup":
                continue
            env = {e["name"]: e for e in container.get("env", [])}
            assert env["CELERY_BROKER_URL"]["valueFrom"]["secretKeyRef"] == {
                "name": "reservation-cleanup",
                "key": "RABBITMQ_BROKER_URL",
            }, where
            assert "CLEANUP_RABBITMQ_QUEUE_TYPE" not in env, where  # the ConfigMap's, not another
            assert {"configMapRef": {"name": "reservation-cleanup"}} in container["envFrom"], where
            checked.append(where)
    assert len(checked) == 9  # four Deployments x (container + init container) + the Job
    # the cluster: three replicas of a pinned image, its pods as the documented URL names them
    (cluster,) = [d for d in docs if d["kind"] == "RabbitmqCluster"]
    assert cluster["spec"]["replicas"] == 3
    assert RABBITMQ_IMAGE.fullmatch(cluster["spec"]["image"]), cluster["spec"]["image"]
    assert "default_vhost = reservations" in cluster["spec"]["rabbitmq"]["additionalConfig"]
    name = cluster["metadata"]["name"]
    header = (RABBITMQ_K8S / "kustomization.yaml").read_text()
    documented = next(line for line in header.splitlines() if "amqp://" in line).strip("# ")
    entries = _broker_entries(documented)
    assert [(e.hostname, e.port, e.path) for e in entries] == [
        (f"{name}-server-{i}.{name}-nodes", 5672, "/reservations") for i in range(3)
    ]
    (pdb,) = [
        d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == name
    ]
    assert pdb["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}
    # KEDA: the Redis-only queue-age trigger goes, the broker-independent ones stay
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    assert [t["name"] for t in scaled["spec"]["triggers"]] == [
        "desired-consumers",
        "oldest-eligible-age",
    ]
    # the base itself is untouched
    assert (
        "CLEANUP_RABBITMQ_QUEUE_TYPE"
        not in next(d for d in k8s_documents() if d["kind"] == "ConfigMap")["data"]
    )
    assert (
        len(next(d for d in k8s_documents() if d["kind"] == "ScaledObject")["spec"]["triggers"])
        == 3
    )


def test_the_rabbitmq_kubernetes_variant_validates_and_kustomize_agrees() -> None:
    """Built-in kinds against the Kubernetes schemas (strict, offline), the RabbitmqCluster
    against the schema in tests/unit/project/schemas (its affinity and resources against the
    Pod's own schema), the trimmed ScaledObject against KEDA's; where kubectl is installed, its
    kustomize renders what the Python rendering above reads."""

    import jsonschema
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    ours = _rabbitmq_k8s_documents()
    for doc in ours:
        if doc["kind"] == "RabbitmqCluster":
            jsonschema.validate(doc, _schema("rabbitmq-cluster.schema.json"))
            spec = doc["spec"]
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "rabbitmq-fields"},
                "spec": {
                    "affinity": spec["affinity"],
                    "containers": [
                        {"name": "rabbitmq", "image": spec["image"], "resources": spec["resources"]}
                    ],
                },
            }
            kubernetes_validate.validate(pod, version, strict=True)
        elif doc["kind"] == "ScaledObject":
            jsonschema.validate(doc, _schema("keda-scaledobject.schema.json"))
        else:
            kubernetes_validate.validate(doc, version, strict=True)
    broken = json.loads(json.dumps(next(d for d in ours if d["kind"] == "RabbitmqCluster")))
    broken["spec"]["replica"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, _schema("rabbitmq-cluster.schema.json"))
    _assert_kubectl_renders(RABBITMQ_K8S, ours)
