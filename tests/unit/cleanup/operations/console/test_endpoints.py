"""The web's operational endpoints (cleanup.operations.console.endpoints): /metrics protection
(token, allow-list, closed on a bad setting), /healthz, /readyz with its checks (and with the
database gone), and the gauges' collector registered with /metrics only."""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test import Client

from cleanup.operations.console.endpoints import metrics_registry
from cleanup.operations.console.gauges import BacklogCollector

# Every test starts and ends with the tests' own Redis database empty.
pytestmark = pytest.mark.usefixtures("broker")


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


def test_collector_is_not_registered_at_import() -> None:
    from prometheus_client import REGISTRY

    gauge = "reservation_cleanup_oldest_eligible_reservation_age_seconds"
    assert gauge not in {m.name for m in REGISTRY.collect()}
    assert any(isinstance(c, BacklogCollector) for c in metrics_registry()._collector_to_names)


# --- /readyz with the database gone -----------------------------------------------------------


@pytest.mark.usefixtures("api_token")
@pytest.mark.django_db(transaction=True)
def test_readyz_is_503_while_the_database_is_unreachable_and_recovers(client, settings):
    # a metrics reader (the token) sees which check failed; anyone else sees only the status
    settings.METRICS_TOKEN = "r" * 40
    client.defaults["HTTP_AUTHORIZATION"] = "Bearer " + "r" * 40
    assert client.get("/readyz").status_code == 200
    # when: the server ends this process's session (a restart, a failover, an admin)
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        pid = cur.fetchone()[0]
    other = connection.copy()
    try:
        with other.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()
    # then: not ready, naming the database
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["ready"] is False
    assert body["checks"]["database"]["ok"] is False
    assert body["checks"]["database"]["error"].split(":")[0] in {
        "OperationalError",
        "InterfaceError",
    }
    assert body["checks"]["broker"]["ok"] is True
    # and the broken handle is not reused: the next request reconnects and is ready
    assert client.get("/readyz").status_code == 200
    # when: the database cannot be reached at all (nothing listens on its port)
    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "9"
    try:
        response = client.get("/readyz")
    finally:
        connection.close()
        connection.settings_dict["PORT"] = real_port
    assert response.status_code == 503
    assert response.json()["checks"]["database"]["ok"] is False
    assert client.get("/readyz").status_code == 200
