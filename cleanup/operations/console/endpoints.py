"""Operational endpoints of the web process: /metrics, /healthz, /readyz.

/metrics access (settings ``METRICS_TOKEN``, ``METRICS_ALLOW_IPS``):
- a request is allowed when it carries ``Authorization: Bearer <METRICS_TOKEN>`` (compared in
  constant time), or when its REMOTE_ADDR is inside one of ``METRICS_ALLOW_IPS`` (addresses or
  CIDR networks); either one suffices when both are set;
- when neither is set, /metrics is open only with DEBUG=True; with DEBUG=False it answers 403
  (fail closed: production must choose a token or an allowlist).
A proxy in front must not forward REMOTE_ADDR from a header you do not control.

/healthz: the process is up (200, no dependencies). /readyz: the database and the broker
answer (503 when either does not). Anyone may read the status; timings and error texts (which
name hosts and ports) are shown only to callers allowed to read /metrics and to staff users,
and are always logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import time
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.registry import Collector

from cleanup import sql
from cleanup.broker import celery_policy
from cleanup.broker.celery_app import app
from cleanup.broker.readers import redis_client
from cleanup.conf import cleanup_settings
from cleanup.operations.console.gauges import BacklogCollector
from reservations.db import scalar

logger = logging.getLogger("cleanup.views")


class _DefaultRegistryCollector(Collector):
    """The process's own metrics (default registry: process, platform, GC, pipeline counters)."""

    def collect(self) -> Any:
        return REGISTRY.collect()


@lru_cache(maxsize=1)
def metrics_registry() -> CollectorRegistry:
    """Built on the first /metrics request: the backlog collector is registered only here.

    Under gunicorn (``gunicorn.conf.py`` sets ``PROMETHEUS_MULTIPROC_DIR``) the counters and
    histograms are every worker process's, added up from their files; otherwise the process's
    own, with its process and GC metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BacklogCollector())
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415 - only in multiprocess mode (docs/LIBRARY-NOTES.md §3)

        MultiProcessCollector(registry)
    else:
        registry.register(_DefaultRegistryCollector())
    return registry


def _client_allowed(remote: str) -> bool:
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return False
    for entry in cleanup_settings().metrics_allow_ips:
        try:
            if address in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _token_ok(request: HttpRequest) -> bool:
    token = cleanup_settings().metrics_token
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if not token or scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())


def metrics_access(request: HttpRequest) -> int | None:
    """None when allowed, else the HTTP status to answer (401 or 403)."""
    conf = cleanup_settings()
    token_set = bool(conf.metrics_token)
    ips_set = bool(conf.metrics_allow_ips)
    if not token_set and not ips_set:
        return None if settings.DEBUG else 403
    if token_set and _token_ok(request):
        return None
    if ips_set and _client_allowed(request.META.get("REMOTE_ADDR", "")):
        return None
    return 401 if token_set else 403


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    denied = metrics_access(request)
    if denied is not None:
        response = HttpResponse(
            "metrics need a bearer token or an allowed address\n",
            status=denied,
            content_type="text/plain",
        )
        if denied == 401:
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(metrics_registry()), content_type=CONTENT_TYPE_LATEST)


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _timed(check: Any) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
        return {
            "ok": False,
            "ms": round((time.perf_counter() - started) * 1000, 2),
            "error": f"{type(exc).__name__}: {str(exc)[:200]}",
        }
    return {"ok": True, "ms": round((time.perf_counter() - started) * 1000, 2)}


def _check_database() -> None:
    scalar(sql.PING)


def _check_broker() -> None:
    if celery_policy.broker_is_redis():
        redis_client().ping()
        return

    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=5)


def _may_see_details(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_staff:
        return True
    conf = cleanup_settings()
    if not conf.metrics_token and not conf.metrics_allow_ips:
        return bool(settings.DEBUG)
    return metrics_access(request) is None


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    checks = {"database": _timed(_check_database), "broker": _timed(_check_broker)}
    ready = all(c["ok"] for c in checks.values())
    if not checks["database"]["ok"]:
        connection.close()  # a broken handle must not serve the next request
    if not ready:
        logger.warning("not ready", extra={"checks": checks})
    if not _may_see_details(request):
        checks = {name: {"ok": check["ok"]} for name, check in checks.items()}
    return JsonResponse({"ready": ready, "checks": checks}, status=200 if ready else 503)
