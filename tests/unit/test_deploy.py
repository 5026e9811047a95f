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

ROOT = Path(__file__).resolve().parents[2]
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

    from cleanup import collectors, metrics

    names: set[str] = set()
    for collector_names in REGISTRY._collector_to_names.values():
        if any(n.startswith(metrics.PREFIX) for n in collector_names):
            names.update(collector_names)
    names.update(f"{metrics.PREFIX}_{name}" for name in collectors.GAUGE_HELP)
    names.update(
        {f"{metrics.PREFIX}_scrape_errors_total", f"{metrics.PREFIX}_scrape_duration_seconds"}
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
    from django.conf import settings

    assert settings.CELERY_WORKER_AUTOSCALER == "cleanup.autoscale:BacklogAutoscaler"
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


def k8s_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
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
    hpas = [d for d in k8s_documents() if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpas
    names = {m["external"]["metric"]["name"] for h in hpas for m in h["spec"]["metrics"]}
    assert names and sorted(names - exported_metrics()) == []


@pytest.mark.parametrize(
    "path",
    [
        "deploy/alerts.yml",
        "deploy/grafana/dashboards/reservation-cleanup.json",
        "deploy/k8s/keda-scaledobject.yaml",
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
    ``dotenv``, running ``probe`` under config.settings.production."""
    import os
    import subprocess
    import sys

    app_env = {
        k: _interpolate(str(v), dotenv)
        for k, v in compose()["services"]["web"]["environment"].items()
    }
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    env.update(app_env)
    return subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def _quick_start_env() -> dict[str, str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_env", ROOT / "scripts" / "make_env.py")
    assert spec and spec.loader
    make_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_env)
    rendered = make_env.render((ROOT / ".env.example").read_text())
    return dict(
        line.split("=", 1) for line in rendered.splitlines() if "=" in line and line[0] != "#"
    )


def test_the_quick_start_env_passes_the_production_settings_checks() -> None:
    """`scripts/make_env.py` + docker-compose.yml give the app containers an environment that
    config.settings.production accepts (it refuses weak or development secrets)."""
    probe = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.DEBUG, s.SECURE_SSL_REDIRECT, s.CELERY_BROKER_URL.split('@')[-1])"
    )
    done = _start_web_settings(_quick_start_env(), probe)
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
    dotenv = {**_quick_start_env(), example_variable: example}
    done = _start_web_settings(dotenv, "import django; django.setup()")
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"django.core.exceptions.ImproperlyConfigured: {refused_variable}")
    secret = example.partition(":")[2] if example_variable == "FLOWER_BASIC_AUTH" else example
    assert secret not in message
