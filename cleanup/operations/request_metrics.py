"""Counts and times every web request by route, method and status (``HTTP_REQUESTS``,
``HTTP_REQUEST_DURATION`` in ``cleanup.metrics``).

Under gunicorn each worker process counts its own requests; ``gunicorn.conf.py`` puts them in
prometheus_client's multiprocess mode, and ``/metrics`` then adds up every process's files, so
one scrape sees all the web's requests whichever process answers it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from cleanup.metrics import HTTP_REQUEST_DURATION, HTTP_REQUESTS

# Anything else a client sends as a method is one label value, not one series per string.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"


def route_of(request: HttpRequest) -> str:
    match = request.resolver_match
    return match.route if match is not None and match.route else UNMATCHED


class RequestMetricsMiddleware:
    """First in MIDDLEWARE, so the time covers every other middleware too."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        method = request.method if request.method in KNOWN_METHODS else "other"
        route = route_of(request)
        HTTP_REQUESTS.labels(route=route, method=method, status=str(response.status_code)).inc()
        HTTP_REQUEST_DURATION.labels(route=route, method=method).observe(
            time.perf_counter() - started
        )
        return response
