"""The API's error answers as RFC 9457 problem details, and the request id every answer carries.

An error is ``application/problem+json``::

    {"type": "/api/v1/problems/no_seats_available", "title": "No seats available",
     "status": 409, "detail": "offering 7 has no seats available",
     "instance": "/api/v1/offerings/7/holds", "code": "no_seats_available", "field": null,
     "request_id": "3f2c..."}

``type`` is a relative URI reference, resolved against the API's own address: the API serves a
description of every type at that path (``GET /api/v1/problems/<code>``), so the URI is both a
stable identifier and a link that works on whichever host serves the API, with no hostname to
keep in sync. ``code`` (the last segment of ``type``) and ``field`` (the body field, parameter
or header at fault, or null) are extension members, as is ``request_id``.

The request id: an incoming ``X-Request-ID`` is kept when it is well formed (1 to 128 of
``A-Z a-z 0-9 . _ : -``), anything else is replaced by a new one. It is answered in the
``X-Request-ID`` header, put in problem bodies, and added to every log line written while the
request runs (``RequestIdLogFilter``). With tracing on (docs/TRACING.md), the request's span
carries it as ``http.request_id``.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.core.signals import request_finished
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt

from reservations.tracecontext import otel_trace

logger = logging.getLogger(__name__)
# The request span's attribute naming the request id (the header's value).
REQUEST_ID_ATTRIBUTE = "http.request_id"

CONTENT_TYPE = "application/problem+json"
REQUEST_ID_HEADER = "X-Request-ID"
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class ProblemType:
    status: int
    title: str
    description: str


# Every problem the API answers, by its code. docs/API.md lists them; the OpenAPI document
# lists, per operation, the ones each status may carry.
PROBLEM_TYPES: dict[str, ProblemType] = {
    "invalid_json": ProblemType(400, "Invalid JSON", "The body is not a JSON object."),
    "unknown_field": ProblemType(
        400, "Unknown field", "The body or query has a field or parameter the operation lacks."
    ),
    "missing_field": ProblemType(400, "Missing field", "A required field is absent."),
    "invalid_type": ProblemType(400, "Invalid type", "A field has the wrong JSON type."),
    "out_of_range": ProblemType(400, "Out of range", "A number is outside its stated bounds."),
    "invalid_value": ProblemType(
        400, "Invalid value", "A string is blank, too long, repeated or not valid text."
    ),
    "invalid_cursor": ProblemType(
        400, "Invalid cursor", "The cursor is not a next_cursor this API returned."
    ),
    "invalid_ttl": ProblemType(
        400, "Invalid TTL", "ttl_seconds is outside 1 to the server's maximum hold TTL."
    ),
    "invalid_content_length": ProblemType(
        400, "Invalid Content-Length", "The Content-Length header is not a length."
    ),
    "invalid_idempotency_key": ProblemType(
        400, "Invalid Idempotency-Key", "The key is not 1 to 255 printable ASCII characters."
    ),
    "unauthorized": ProblemType(401, "Unauthorized", "No bearer token, or one not accepted."),
    "insufficient_scope": ProblemType(
        403, "Insufficient scope", "The client lacks the read (GET) or write (POST) scope."
    ),
    "not_found": ProblemType(404, "Not found", "No operation has this path."),
    "offering_not_found": ProblemType(
        404, "Offering not found", "No such offering, or not one this client may use."
    ),
    "reservation_not_found": ProblemType(
        404, "Hold not found", "No such hold, or one another client created."
    ),
    "method_not_allowed": ProblemType(
        405, "Method not allowed", "The path does not take this method; Allow lists those it does."
    ),
    "stale_version": ProblemType(
        409, "Stale version", "expected_version is not the hold's current version."
    ),
    "not_held": ProblemType(409, "Not held", "The hold is confirmed, cancelled or released."),
    "hold_expired": ProblemType(409, "Hold expired", "The hold's expires_at has passed."),
    "no_seats_available": ProblemType(
        409, "No seats available", "The offering has no seat to hold."
    ),
    "body_too_large": ProblemType(413, "Body too large", "The body exceeds the server's limit."),
    "idempotency_key_reused": ProblemType(
        422, "Idempotency-Key reused", "The key was used for another path or body."
    ),
    "rate_limited": ProblemType(
        429, "Rate limited", "The client's requests per minute are used up; see Retry-After."
    ),
    "internal_error": ProblemType(
        500, "Internal error", "The server failed; the request id finds it in the logs."
    ),
    "temporarily_unavailable": ProblemType(
        503, "Temporarily unavailable", "A database conflict outlived the retries; see Retry-After."
    ),
}

# A status the API's views never answer themselves (Django's, or a middleware's): its code.
_FALLBACK_CODES = {400: "invalid_value", 404: "not_found", 405: "method_not_allowed"}


# --- request ids -------------------------------------------------------------------------------

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "reservations_request_id", default=None
)


# The request span's (trace id, span id) in hex, with tracing on.
_request_trace: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "reservations_request_trace", default=None
)


def current_request_id() -> str | None:
    return _request_id.get()


def begin_request(request: HttpRequest) -> str:
    """The request's id (the client's, when well formed; else a new one), made current for this
    request's log lines until it finishes."""
    sent = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = sent if REQUEST_ID_PATTERN.fullmatch(sent) else uuid.uuid4().hex
    _request_id.set(request_id)
    request.request_id = request_id  # type: ignore[attr-defined]
    if otel_trace is not None:
        # The Django instrumentation's request span, when tracing is on (else a no-op span).
        span = otel_trace.get_current_span()
        span.set_attribute(REQUEST_ID_ATTRIBUTE, request_id)
        context = span.get_span_context()
        if context.is_valid:
            # Django logs a 4xx or 5xx after the span has ended: the request's lines keep its ids.
            _request_trace.set((format(context.trace_id, "032x"), format(context.span_id, "016x")))
    return request_id


def tag_request_span(attributes: Mapping[str, Any]) -> None:
    """Name what the request worked on in its span (with tracing on; nothing otherwise): a
    hold's ``reservation.id`` joins the request's trace to the sweep's that releases it."""
    if otel_trace is not None:
        otel_trace.get_current_span().set_attributes(dict(attributes))


def request_id_of(request: HttpRequest) -> str:
    """The id ``begin_request`` gave the request, giving it one now if no middleware did."""
    found = getattr(request, "request_id", None)
    return found if isinstance(found, str) else begin_request(request)


def _forget_request_id(**_: Any) -> None:
    # After the response is closed (Django logs a 4xx or 5xx before that, with the id).
    _request_id.set(None)
    _request_trace.set(None)


request_finished.connect(_forget_request_id, dispatch_uid="reservations.problems.request_id")


class RequestIdLogFilter(logging.Filter):
    """Adds ``request_id`` to every record logged while an API request runs (add it to the log
    handlers: config/settings/base.py does), and with tracing on the request span's
    ``trace_id`` and ``span_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = _request_id.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        ids = _request_trace.get()
        if ids is not None and not hasattr(record, "trace_id"):
            record.trace_id, record.span_id = ids
        return True


# --- problem answers ---------------------------------------------------------------------------


@functools.cache
def type_uri(code: str) -> str:
    return reverse("reservations:problem-type", kwargs={"code": code})


def body(
    code: str, detail: str, *, status: int, field: str | None = None, instance: str | None = None
) -> dict[str, Any]:
    """A problem body, without the request id (stored with idempotent answers, which a later
    request replays under its own id)."""
    known = PROBLEM_TYPES.get(code)
    return {
        "type": type_uri(code),
        "title": known.title if known else code.replace("_", " ").capitalize(),
        "status": status,
        "detail": detail,
        "instance": instance,
        "code": code,
        "field": field,
    }


def answer(
    request: HttpRequest,
    status: int,
    data: Any,
    headers: Mapping[str, str] | None = None,
) -> JsonResponse:
    """A JSON answer: for a status of 400 or more, a problem with the request's id."""
    if status >= 400 and isinstance(data, dict):
        data = {**_upgraded(data, status, request), "request_id": request_id_of(request)}
        response = JsonResponse(data, status=status, content_type=CONTENT_TYPE)
    else:
        response = JsonResponse(data, status=status, safe=False)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def _upgraded(data: dict[str, Any], status: int, request: HttpRequest) -> dict[str, Any]:
    """A body stored under an Idempotency-Key in the earlier ``{"error": {...}}`` form, as a
    problem (such a key is replayed until it expires)."""
    error = data.get("error")
    if "type" in data or not isinstance(error, dict):
        return data
    return body(
        str(error.get("code")),
        str(error.get("message")),
        status=status,
        field=error.get("field"),
        instance=request.path,
    )


def problem(
    request: HttpRequest,
    status: int,
    code: str,
    detail: str,
    *,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JsonResponse:
    return answer(
        request,
        status,
        body(code, detail, status=status, field=field, instance=request.path),
        headers,
    )


def is_json(response: HttpResponse) -> bool:
    content_type = response.get("Content-Type", "")
    return content_type.startswith(("application/json", CONTENT_TYPE))


def _api_prefix() -> str:
    return reverse("reservations:problem-type", kwargs={"code": "x"}).removesuffix("problems/x")


class ApiRequestMiddleware:
    """Under the API's prefix: a request id for every request (header, logs, problem bodies),
    and a problem answer wherever something other than the API's views answered an error
    (Django's 404 for a path no route takes, its 500 for an exception nothing caught).

    First in MIDDLEWARE, so every later middleware's log lines carry the id too."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.prefix = _api_prefix()

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith(self.prefix):
            return self.get_response(request)
        request_id = begin_request(request)
        response = self.get_response(request)
        if response.status_code >= 400 and not is_json(response):
            status = response.status_code
            code = _FALLBACK_CODES.get(status, "internal_error" if status >= 500 else "")
            if code:
                allow = {}
                if response.has_header("Allow"):
                    methods = sorted(m.strip() for m in response["Allow"].split(",") if m.strip())
                    allow = {"Allow": ", ".join(methods)}
                response = problem(request, status, code, _detail(code, request), headers=allow)
        response[REQUEST_ID_HEADER] = request_id
        return response

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if not request.path.startswith(self.prefix):
            return None
        logger.exception("unhandled error in an API request", extra={"path": request.path})
        return problem(request, 500, "internal_error", _detail("internal_error", request))


def _detail(code: str, request: HttpRequest) -> str:
    if code == "not_found":
        return f"no operation has the path {request.path}"
    if code == "method_not_allowed":
        return f"method {request.method} is not allowed here"
    return PROBLEM_TYPES[code].description


@csrf_exempt
def describe(request: HttpRequest, code: str) -> JsonResponse:
    """``GET /api/v1/problems/<code>``: what a problem type means (its ``type`` URI's target)."""
    known = PROBLEM_TYPES.get(code)
    if known is None:
        return problem(request, 404, "not_found", f"no problem type {code!r}")
    if request.method not in ("GET", "HEAD"):
        return problem(
            request,
            405,
            "method_not_allowed",
            _detail("method_not_allowed", request),
            headers={"Allow": "GET, HEAD"},
        )
    return answer(
        request,
        200,
        {
            "type": type_uri(code),
            "code": code,
            "title": known.title,
            "status": known.status,
            "description": known.description,
        },
    )
