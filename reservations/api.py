"""The JSON API: django-ninja operations over ``reservations.services``. Each operation is
declared once, below, and that declaration both serves requests and generates the OpenAPI
document (``reservations.openapi`` adds what ninja cannot declare). Every user-input failure is
a JSON 4xx; nothing a client sends yields a 500.

ninja routes, authenticates (``BearerToken``, which also counts the rate limit) and validates
the path ids, query parameters and the Idempotency-Key header against their declarations; the
request bodies are read by the strict parsers here, which answer each error with the field at
fault, in the order clients rely on, and are declared in the document from the same schemas
(``HoldRequest`` ...). tests/integration/test_api_conformance.py holds the two to each other.

Errors are RFC 9457 problem details (``reservations.problems``): ``type``, ``title``, ``status``,
``detail``, ``instance``, and the stable ``code``, the ``field`` at fault and the ``request_id``.

Who may do what is ``reservations.clients`` (tokens, scopes, offerings, rate limits, which holds
a client sees); a POST under an ``Idempotency-Key`` runs through ``reservations.idempotency``.
docs/API.md describes the whole surface.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import partial, wraps
from typing import Any, Literal

from django.db import OperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt
from ninja import Header, NinjaAPI, Path, Query, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.openapi.docs import Swagger
from ninja.security import HttpBearer
from pydantic import ConfigDict, Field, StrictInt, StrictStr

from . import clients, conf, idempotency, problems, ratelimit, services
from .clients import Principal
from .errors import (
    InvalidTtl,
    OfferingNotFound,
    ReservationError,
    ReservationNotFound,
    StaleVersion,
)
from .idempotency import HEADER as IDEMPOTENCY_HEADER
from .idempotency import KEY_PATTERN
from .models import Offering, Reservation
from .retry import call_with_retries, is_transient_db_error

logger = logging.getLogger(__name__)

View = Callable[..., HttpResponse]

# Ids and versions live in bigint / integer columns; anything larger cannot exist.
MAX_ID = 2**63 - 1
MAX_VERSION = 2**31 - 1
HOLDER_MAX_LENGTH = Reservation._meta.get_field("holder").max_length or 200

# After the retries (reservations.retry) the client is told to come back (503 + Retry-After).
RETRY_AFTER_SECONDS = 1

_NOT_FOUND = (OfferingNotFound, ReservationNotFound)


class ApiError(Exception):
    """A client error with its HTTP status, stable code and (for 400s) the offending field."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = dict(headers or {})

    def response(self, request: HttpRequest) -> JsonResponse:
        """The error as the API answers it: its status, a problem body and its headers."""
        return problems.problem(
            request,
            self.status,
            self.code,
            self.message,
            field=self.field,
            headers=self.headers,
        )


# --- request handling ----------------------------------------------------------------------


# The request attribute holding the rate limiter's decision, whose headers every answer to
# the request carries.
_RATE_LIMIT_ATTRIBUTE = "reservations_rate_limit"


def _count_request(request: HttpRequest, principal: Principal) -> None:
    """Counts the request against the client's rate limit (429 once it is used up)."""
    if principal.client_id is None or principal.requests_per_minute is None:
        return
    decision = ratelimit.check(principal.client_id, principal.requests_per_minute)
    setattr(request, _RATE_LIMIT_ATTRIBUTE, decision)
    if decision is not None and not decision.allowed:
        raise ApiError(
            429,
            "rate_limited",
            f"this client's {decision.limit} requests per {ratelimit.WINDOW_SECONDS} s are "
            f"used up; retry in {decision.reset_seconds} s",
        )


def _require_scope(principal: Principal, method: str) -> None:
    """GET and HEAD need the read scope; every other method the write scope."""
    if method in ("GET", "HEAD"):
        allowed, scope = principal.can_read, "read"
    else:
        allowed, scope = principal.can_write, "write"
    if not allowed:
        raise ApiError(403, "insufficient_scope", f"this client has no {scope} scope")


def _read_body(request: HttpRequest) -> bytes:
    """The raw body, refusing anything over the limit by its declared and its actual length."""
    limit: int = conf.value("RESERVATIONS_API_MAX_BODY_BYTES")
    declared = request.META.get("CONTENT_LENGTH") or ""
    if declared:
        try:
            length = int(declared)
        except ValueError:
            raise ApiError(400, "invalid_content_length", "bad Content-Length") from None
        if length < 0:
            raise ApiError(400, "invalid_content_length", "Content-Length is negative")
        if length > limit:
            raise ApiError(413, "body_too_large", f"request body exceeds {limit} bytes")
    # Read one byte past the limit: a body without (or with a wrong) Content-Length is still
    # caught without buffering more than the limit.
    raw = request.read(limit + 1)
    if len(raw) > limit:
        raise ApiError(413, "body_too_large", f"request body exceeds {limit} bytes")
    return raw


def _json_object(request: HttpRequest, allowed: frozenset[str]) -> dict[str, Any]:
    raw = _read_body(request)
    if not raw.strip():
        raise ApiError(400, "invalid_json", "request body must be a JSON object", field="body")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, "invalid_json", "body is not valid JSON", field="body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "request body must be a JSON object", field="body")
    for key in data:
        if key not in allowed:
            raise ApiError(400, "unknown_field", f"unknown field {key!r}", field=key)
    return data


def _int_field(
    data: Mapping[str, Any], name: str, *, required: bool, minimum: int, maximum: int
) -> int | None:
    value = data.get(name)
    if value is None:
        if required:
            raise ApiError(400, "missing_field", f"{name} is required", field=name)
        return None
    # JSON has one number type: 1893.0 is the integer 1893, as the document's "integer" says.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    # bool is a subclass of int: true must not read as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, "invalid_type", f"{name} must be an integer", field=name)
    if not minimum <= value <= maximum:
        raise ApiError(
            400, "out_of_range", f"{name} must be between {minimum} and {maximum}", field=name
        )
    return value


def _holder(data: Mapping[str, Any]) -> str:
    if "holder" not in data:
        raise ApiError(400, "missing_field", "holder is required", field="holder")
    holder = data["holder"]
    if not isinstance(holder, str):
        raise ApiError(400, "invalid_type", "holder must be a string", field="holder")
    if not holder.strip():
        raise ApiError(400, "invalid_value", "holder must not be blank", field="holder")
    if len(holder) > HOLDER_MAX_LENGTH:
        raise ApiError(
            400,
            "invalid_value",
            f"holder must be at most {HOLDER_MAX_LENGTH} characters",
            field="holder",
        )
    # PostgreSQL text cannot hold NUL, and a lone surrogate cannot be encoded as UTF-8.
    if "\x00" in holder:
        raise ApiError(400, "invalid_value", "holder must not contain NUL", field="holder")
    try:
        holder.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "invalid_value", "holder is not valid text", field="holder") from None
    return holder


def _ttl(data: Mapping[str, Any]) -> int | None:
    # The range is the service's to enforce (InvalidTtl); here only the type is checked.
    return _int_field(data, "ttl_seconds", required=False, minimum=-MAX_ID, maximum=MAX_ID)


def _expected_version(data: Mapping[str, Any]) -> int:
    version = _int_field(data, "expected_version", required=True, minimum=1, maximum=MAX_VERSION)
    assert version is not None  # required=True
    return version


def _check_id(value: int, code: str, what: str) -> None:
    if not 1 <= value <= MAX_ID:
        raise ApiError(404, code, f"{what} {value} does not exist")


def hold_json(hold: Reservation) -> dict[str, Any]:
    return {
        "id": hold.pk,
        "offering_id": hold.offering_id,
        "holder": hold.holder,
        "status": hold.status,
        "version": hold.version,
        "expires_at": hold.expires_at.isoformat(),
        "released_version": hold.released_version,
        "bucket": hold.bucket,
        "created_at": hold.created_at.isoformat(),
        "released_at": hold.released_at.isoformat() if hold.released_at else None,
    }


def _domain_error(request: HttpRequest, exc: ReservationError) -> tuple[int, dict[str, Any]]:
    """The status and problem body for a domain error."""
    if isinstance(exc, InvalidTtl):
        status, field = 400, "ttl_seconds"
    elif isinstance(exc, _NOT_FOUND):
        status, field = 404, None
    elif isinstance(exc, StaleVersion):
        status, field = 409, "expected_version"
    elif isinstance(exc, idempotency.InvalidIdempotencyKey):
        status, field = 400, idempotency.HEADER
    elif isinstance(exc, idempotency.IdempotencyKeyReused):
        status, field = 422, idempotency.HEADER
    else:
        status, field = 409, None
    message = str(exc) or exc.code
    return status, problems.body(
        exc.code, message, status=status, field=field, instance=request.path
    )


# --- what the operations do --------------------------------------------------------------

_HOLD_FIELDS = frozenset({"holder", "ttl_seconds"})
_RENEW_FIELDS = frozenset({"expected_version", "ttl_seconds"})
_VERSION_FIELDS = frozenset({"expected_version"})

# What a path id names: the error code and word of its 404.
_OFFERING = (OfferingNotFound.code, "offering")
_HOLD = (ReservationNotFound.code, "hold")

# Listings: a page holds this many holds unless the client asks for fewer (or up to the max).
PAGE_SIZE = 50
MAX_PAGE_SIZE = 100


def _idempotency_key(request: HttpRequest) -> str | None:
    value = request.headers.get(idempotency.HEADER)
    return None if value is None else idempotency.check_key(value)


def _hold_change(
    request: HttpRequest,
    principal: Principal,
    target_id: int,
    target: tuple[str, str],
    fields: frozenset[str],
    parse: Callable[[dict[str, Any]], Callable[[], Reservation]],
    status: int = 200,
) -> HttpResponse:
    """Every POST that changes a hold, in order:

    1. the path id is in range (else 404 with the target's code);
    2. the body is a JSON object with only ``fields`` (else 400), and the
       ``Idempotency-Key``, when sent, is well formed (else 400);
    3. ``parse`` reads and validates the fields and returns the service call, so a bad field
       is a 400 before any database work;
    4. the target is the principal's to use (else the same 404: another client's hold does
       not exist for this one);
    5. the call runs, retried on transient database errors, under the key when one was sent
       (a repeat replays the stored response); the answer is the hold, or the domain error.
    """
    _check_id(target_id, *target)
    data = _json_object(request, fields)
    key = _idempotency_key(request)
    call = parse(data)
    _check_access(principal, target_id, target)

    def produce() -> idempotency.Response:
        try:
            hold = call_with_retries(call)
        except ReservationError as exc:
            return idempotency.Response(*_domain_error(request, exc))
        problems.tag_request_span({"reservation.id": hold.pk, "reservation.version": hold.version})
        headers = {"Location": _hold_location(hold.pk)} if status == 201 else {}
        return idempotency.Response(status, hold_json(hold), headers)

    if key is None:
        response = produce()
    else:
        fingerprint = idempotency.request_hash(request.method or "POST", request.path, data)
        response = idempotency.run_once(principal.client_id, key, fingerprint, produce)
    answer = problems.answer(request, response.status, response.body, response.headers)
    if key is not None:
        answer["Idempotent-Replayed"] = "true" if response.replayed else "false"
    return answer


def _check_access(principal: Principal, target_id: int, target: tuple[str, str]) -> None:
    code, what = target
    if target is _HOLD:
        allowed = clients.owned_hold(principal, target_id) is not None
    else:
        allowed = clients.may_use_offering(principal, target_id)
    if not allowed:
        raise ApiError(404, code, f"{what} {target_id} does not exist")


def _hold_location(hold_id: int) -> str:
    return reverse("reservations:hold-detail", kwargs={"hold_id": hold_id})


def _page(
    request: HttpRequest,
    principal: Principal,
    extra: frozenset[str],
    *,
    holder: str | None = None,
    offering_id: int | None = None,
) -> HttpResponse:
    """One page of a listing: ``limit`` (1 to 100, default 50) holds in id order after
    ``cursor`` (the previous page's ``next_cursor``); ``next_cursor`` is null on the last."""
    query = request.GET
    for name in query:
        if name not in extra | {"cursor", "limit"}:
            raise ApiError(400, "unknown_field", f"unknown parameter {name!r}", field=name)
        if len(query.getlist(name)) > 1:
            raise ApiError(400, "invalid_value", f"{name} is given more than once", field=name)
    limit = PAGE_SIZE
    if "limit" in query:
        text = query["limit"]
        if not text.isascii() or not text.isdigit():
            raise ApiError(400, "invalid_type", "limit must be an integer", field="limit")
        limit = int(text)
        if not 1 <= limit <= MAX_PAGE_SIZE:
            raise ApiError(
                400, "out_of_range", f"limit must be between 1 and {MAX_PAGE_SIZE}", field="limit"
            )
    after = 0
    if "cursor" in query:
        try:
            after = clients.decode_cursor(query["cursor"])
        except clients.InvalidCursor:
            raise ApiError(
                400, "invalid_cursor", "cursor is not one this API returned", field="cursor"
            ) from None
    page = clients.list_holds(
        principal, holder=holder, offering_id=offering_id, after_id=after, limit=limit
    )
    return JsonResponse(
        {"holds": [hold_json(h) for h in page.holds], "next_cursor": page.next_cursor}
    )


# --- schemas -----------------------------------------------------------------------------------


class Strict(Schema):
    # Unknown fields are refused (400 unknown_field): additionalProperties false.
    model_config = ConfigDict(extra="forbid")


# At least one character that is not whitespace, and no NUL (PostgreSQL text cannot hold it).
HOLDER_PATTERN = r"^[^\x00]*[^\s\x00][^\x00]*$"
MAX_TTL = conf.value("RESERVATIONS_MAX_HOLD_TTL_SECONDS")
DEFAULT_TTL = conf.value("RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS")
_TTL_DESCRIPTION = (
    f"seconds until the hold expires, 1 to {MAX_TTL} (RESERVATIONS_MAX_HOLD_TTL_SECONDS); "
    f"absent or null: {DEFAULT_TTL} (RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS)"
)
_VERSION_DESCRIPTION = (
    "the hold's version as the client last saw it: the change applies only if it is still the "
    "hold's version (else 409 stale_version). An integral number such as 3.0 is read as 3."
)


class HoldRequest(Strict):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"holder": "ann", "ttl_seconds": 600}]}
    )

    holder: StrictStr = Field(
        min_length=1,
        max_length=HOLDER_MAX_LENGTH,
        pattern=HOLDER_PATTERN,
        description="who the seat is held for: not blank, no NUL",
        examples=["ann"],
    )
    ttl_seconds: StrictInt | None = Field(None, ge=1, le=MAX_TTL, description=_TTL_DESCRIPTION)


class RenewRequest(Strict):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"expected_version": 1, "ttl_seconds": 600}]},
    )

    expected_version: StrictInt = Field(ge=1, le=MAX_VERSION, description=_VERSION_DESCRIPTION)
    ttl_seconds: StrictInt | None = Field(None, ge=1, le=MAX_TTL, description=_TTL_DESCRIPTION)


class VersionRequest(Strict):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"expected_version": 1}]}
    )

    expected_version: StrictInt = Field(ge=1, le=MAX_VERSION, description=_VERSION_DESCRIPTION)


class Hold(Schema):
    id: int = Field(description="the hold's id (its path: /api/v1/holds/{id})", examples=[42])
    offering_id: int = Field(description="the offering the seat is on")
    holder: str = Field(description="who the seat is held for, as given when it was held")
    status: Literal["held", "confirmed", "released", "cancelled"] = Field(
        description="held: the seat is the holder's until expires_at; confirmed: for good; "
        "released: it expired and the seat went back; cancelled: given back"
    )
    version: int = Field(
        description="bumped by every change (renew, confirm, cancel): send it as expected_version"
    )
    expires_at: datetime = Field(description="when a held hold stops holding the seat")
    released_version: int | None = Field(
        description="the version the cleanup released (null unless released)"
    )
    bucket: int = Field(description="the cleanup's shard bucket (id mod 1024)")
    created_at: datetime
    released_at: datetime | None = Field(description="when the cleanup released it, or null")


class HoldPage(Schema):
    holds: list[Hold] = Field(description="in id order")
    next_cursor: str | None = Field(
        description="pass as `cursor` for the next page; null: this is the last page",
        examples=["AAAAAAAAACo"],
    )


class Availability(Schema):
    offering_id: int
    capacity: int = Field(description="the offering's seats in all")
    seats_available: int = Field(
        description="the free-seat counter: seats no hold or confirmation takes now. Holds "
        "that expired are counted as taken until the cleanup releases them (seconds, usually)"
    )
    held: int = Field(description="holds with status held, expired or not")
    eligible: int = Field(
        description="held holds past their expires_at that the cleanup has not released yet: "
        "their seats are as good as free"
    )
    confirmed: int = Field(description="confirmed holds")
    available: int = Field(
        description="seats a learner can get now: seats_available + eligible. Show this one; "
        "seats_available lags it by the cleanup's delay"
    )


class Error(Schema):
    """An RFC 9457 problem (``application/problem+json``), with the API's extension members."""

    type: str = Field(
        description="a URI reference naming the problem type: GET it for its description",
        examples=["/api/v1/problems/no_seats_available"],
    )
    title: str = Field(description="the problem type's short, fixed summary")
    status: int = Field(description="the answer's HTTP status")
    detail: str = Field(description="what went wrong with this request")
    instance: str | None = Field(description="the request's path")
    code: str = Field(description="the stable code: the last segment of `type`")
    field: str | None = Field(description="the body field, parameter or header at fault")
    request_id: str = Field(description="the X-Request-ID this request was answered under")


# --- parameters ------------------------------------------------------------------------------

OfferingId = Path(..., ge=1, le=MAX_ID, description="the offering's id", examples=[7])
HoldId = Path(..., ge=1, le=MAX_ID, description="the hold's id", examples=[42])
Key = Header(
    None,
    alias=IDEMPOTENCY_HEADER,
    min_length=1,
    max_length=255,
    pattern=f"^{KEY_PATTERN.pattern}$",
    description="1 to 255 printable ASCII characters, no spaces (a UUID, say): a retry with the "
    "same key and request replays the first answer, for RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS",
    examples=["9f1c2d7e-3b4a-4c5d-8e6f-7a8b9c0d1e2f"],
)
# Its shape is stated in the document (reservations.openapi), not enforced by ninja: a cursor
# of the earlier shape is still read (clients.decode_cursor).
Cursor = Query(
    None,
    description="the previous page's next_cursor (absent: the first page)",
    examples=["AAAAAAAAACo"],
)
Limit = Query(PAGE_SIZE, ge=1, le=MAX_PAGE_SIZE, description="holds per page")


HolderQuery = Query(
    ...,
    min_length=1,
    max_length=HOLDER_MAX_LENGTH,
    pattern=HOLDER_PATTERN,
    description="who the holds are for",
    examples=["ann"],
)


# --- serving: django-ninja ----------------------------------------------------------------------


class BearerToken(HttpBearer):
    """An API client's token (admin: API clients), or the local development token. The request
    is counted against the client's rate limit here, before anything else is looked at."""

    def authenticate(self, request: HttpRequest, token: str) -> Principal | None:
        principal = clients.authenticate(token.strip()) if token.strip() else None
        if principal is not None:
            _count_request(request, principal)
        return principal


api = NinjaAPI(
    title="Reservations API",
    version="1",
    description=(
        "Hold, renew, confirm and cancel seats on offerings. Every error is an RFC 9457 "
        "problem (`application/problem+json`) with a stable `code`. POSTs accept an "
        "`Idempotency-Key` header: a retry with the same key and request replays the first "
        "response. Each client sees only the holds it created."
    ),
    auth=BearerToken(),
    urls_namespace="reservations",
    docs=Swagger(),
    # reservations.openapi serves the document and the staff's page (reservations.urls).
    openapi_url=None,
    docs_url=None,
)


def _finish(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """What every answer carries: the request id, and the rate limiter's fields."""
    response[problems.REQUEST_ID_HEADER] = problems.request_id_of(request)
    decision = getattr(request, _RATE_LIMIT_ATTRIBUTE, None)
    if decision is not None:
        for name, value in decision.headers().items():
            response[name] = value
    return response


def _error_answer(request: HttpRequest, exc: Exception) -> HttpResponse:
    """The problem answer for anything an operation (or ninja before it) raised."""
    if isinstance(exc, ApiError):
        return exc.response(request)
    if isinstance(exc, ReservationError):
        return problems.answer(request, *_domain_error(request, exc))
    if isinstance(exc, AuthenticationError):
        return _UNAUTHORIZED.response(request)
    if isinstance(exc, ValidationError):
        return _parameter_error(exc).response(request)
    if isinstance(exc, Http404):
        return ApiError(404, "not_found", f"no operation has the path {request.path}").response(
            request
        )
    if isinstance(exc, OperationalError | services.TransientConflict) and is_transient_db_error(
        exc
    ):
        logger.warning(
            "transient database error persisted after retries",
            extra={"path": request.path, "error": type(exc.__cause__ or exc).__name__},
        )
        return ApiError(
            503,
            "temporarily_unavailable",
            "the request conflicted with concurrent changes; retry shortly",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        ).response(request)
    # Without ApiRequestMiddleware too, an API answer is never Django's HTML 500.
    logger.error(
        "unhandled error in an API request",
        exc_info=(type(exc), exc, exc.__traceback__),
        extra={"path": request.path},
    )
    return problems.problem(
        request, 500, "internal_error", problems.PROBLEM_TYPES["internal_error"].description
    )


_UNAUTHORIZED = ApiError(
    401,
    "unauthorized",
    "missing or invalid bearer token",
    headers={"WWW-Authenticate": 'Bearer realm="reservations"'},
)


def _handle(request: HttpRequest, exc: Exception) -> HttpResponse:
    return _finish(request, _error_answer(request, exc))


# ninja's own handlers for these would answer its error bodies: every one is a problem here.
for _raised in (Exception, AuthenticationError, HttpError, ValidationError, Http404):
    api.add_exception_handler(_raised, _handle)  # type: ignore[arg-type]

# Path ids ninja refused (out of range): the 404 of what the id names.
_PATH_NOT_FOUND = {"offering_id": _OFFERING, "hold_id": _HOLD}
# Pydantic's error types, as the API's problem codes.
_PARAMETER_CODES = {
    "missing": "missing_field",
    "int_parsing": "invalid_type",
    "int_type": "invalid_type",
    "string_type": "invalid_type",
    "greater_than_equal": "out_of_range",
    "less_than_equal": "out_of_range",
}


def _parameter_error(exc: ValidationError) -> ApiError:
    """The first parameter ninja refused, as the hand-written checks would have answered it."""
    error = exc.errors[0]
    where, name = (list(error.get("loc", ())) + ["", ""])[:2]
    name = str(name)
    if where == "path" and name in _PATH_NOT_FOUND:
        code, what = _PATH_NOT_FOUND[name]
        return ApiError(404, code, f"{what} does not exist")
    if name.lower() == idempotency.HEADER.lower():
        return ApiError(
            400,
            idempotency.InvalidIdempotencyKey.code,
            "Idempotency-Key must be 1 to 255 printable ASCII characters without spaces",
            field=idempotency.HEADER,
        )
    if name == "cursor":
        return ApiError(400, "invalid_cursor", "cursor is not one this API returned", field=name)
    code = _PARAMETER_CODES.get(str(error.get("type")), "invalid_value")
    return ApiError(400, code, f"{name}: {error.get('msg', 'invalid')}", field=name)


def _answers(*, check_scope: bool = True) -> Callable[[View], View]:
    """Around an operation: the scope check (GET and HEAD read, anything else writes), and
    every error it raises as a problem."""

    def decorate(view: View) -> View:
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if check_scope:
                    _require_scope(request.auth, request.method or "")  # type: ignore[attr-defined]
                response = view(request, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - every error becomes a problem
                response = _error_answer(request, exc)
            return _finish(request, response)

        return wrapper

    return decorate


def _principal(request: HttpRequest) -> Principal:
    principal: Principal = request.auth  # type: ignore[attr-defined]
    return principal


def _body(model: type[Schema]) -> dict[str, Any]:
    """A request body for the document: ``model``'s schema (the strict parsers above read the
    body, so that each error names its field as clients rely on)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    }


# Every operation can be refused for these: no or a bad token, a missing scope, the rate limit
# (429 with Retry-After), a database conflict that outlived the retries (503 with Retry-After).
_ALWAYS: dict[int, type[Schema]] = {401: Error, 403: Error, 429: Error, 503: Error}
_CHANGE_RESPONSES = {200: Hold, 400: Error, 404: Error, 409: Error, 413: Error, 422: Error}
READ = ["GET", "HEAD"]
_EVERY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"]

OFFERING_HOLDS = "offerings/{int:offering_id}/holds"
AVAILABILITY = "offerings/{int:offering_id}/availability"
HOLDS = "holds"
HOLD = "holds/{int:hold_id}"
RENEW = "holds/{int:hold_id}/renew"
CONFIRM = "holds/{int:hold_id}/confirm"
CANCEL = "holds/{int:hold_id}/cancel"


@api.post(
    OFFERING_HOLDS,
    response={201: Hold, 400: Error, 404: Error, 409: Error, 413: Error, 422: Error, **_ALWAYS},
    summary="Hold a seat",
    description=(
        "Takes a seat on the offering for `holder` until `expires_at` (201, the hold, and "
        "`Location`). No seat left: 409 `no_seats_available`. Send an `Idempotency-Key` to retry "
        "safely: the retry gets the first answer and takes no second seat."
    ),
    tags=["Holds"],
    operation_id="create_hold",
    url_name="offering-holds",
    openapi_extra=_body(HoldRequest),
)
@_answers()
def create_hold(
    request: HttpRequest, offering_id: int = OfferingId, key: str | None = Key
) -> HttpResponse:
    principal = _principal(request)
    return _hold_change(
        request,
        principal,
        offering_id,
        _OFFERING,
        _HOLD_FIELDS,
        lambda data: partial(
            services.hold_seat,
            offering_id,
            _holder(data),
            _ttl(data),
            client_id=principal.client_id,
        ),
        status=201,
    )


@api.api_operation(
    READ,
    OFFERING_HOLDS,
    response={200: HoldPage, 400: Error, 404: Error, **_ALWAYS},
    summary="This client's holds on an offering, by cursor",
    description=(
        "The holds this client created on the offering, in id order, `limit` a page; pass "
        "`next_cursor` back as `cursor` for the next page. Unknown or repeated parameters: 400."
    ),
    tags=["Offerings", "Holds"],
    operation_id="list_offering_holds",
)
@_answers()
def list_offering_holds(
    request: HttpRequest,
    offering_id: int = OfferingId,
    cursor: str | None = Cursor,
    limit: int = Limit,
) -> HttpResponse:
    principal = _principal(request)
    _check_access(principal, offering_id, _OFFERING)
    if not Offering.objects.filter(pk=offering_id).exists():
        raise OfferingNotFound(f"offering {offering_id} does not exist")
    return _page(request, principal, frozenset(), offering_id=offering_id)


@api.api_operation(
    READ,
    AVAILABILITY,
    response={200: Availability, 404: Error, **_ALWAYS},
    summary="Seats a learner can get now",
    description=(
        "The offering's seats: `available` is what a learner can get now (free seats plus holds "
        "that expired and await the cleanup); `seats_available` is the free-seat counter alone."
    ),
    tags=["Offerings"],
    operation_id="offering_availability",
    url_name="availability",
)
@_answers()
def offering_availability(request: HttpRequest, offering_id: int = OfferingId) -> HttpResponse:
    _check_access(_principal(request), offering_id, _OFFERING)
    return JsonResponse(services.availability(offering_id))


@api.api_operation(
    READ,
    HOLDS,
    response={200: HoldPage, 400: Error, **_ALWAYS},
    summary="This client's holds of one holder, by cursor",
    description=(
        "The holds this client created for `holder`, on offerings it may still use, in id "
        "order, by cursor as for an offering's holds."
    ),
    tags=["Holds"],
    operation_id="list_holder_holds",
    url_name="holds",
)
@_answers()
def list_holder_holds(
    request: HttpRequest,
    holder: str = HolderQuery,
    cursor: str | None = Cursor,
    limit: int = Limit,
) -> HttpResponse:
    return _page(request, _principal(request), frozenset({"holder"}), holder=_holder(request.GET))


@api.api_operation(
    READ,
    HOLD,
    response={200: Hold, 404: Error, **_ALWAYS},
    summary="A hold's current state",
    description="The hold, if this client created it (any other client's hold: 404).",
    tags=["Holds"],
    operation_id="hold_detail",
    url_name="hold-detail",
)
@_answers()
def hold_detail(request: HttpRequest, hold_id: int = HoldId) -> HttpResponse:
    hold = clients.owned_hold(_principal(request), hold_id)
    if hold is None:
        raise ReservationNotFound(f"hold {hold_id} does not exist")
    return JsonResponse(hold_json(hold))


@api.post(
    RENEW,
    response={**_CHANGE_RESPONSES, **_ALWAYS},
    summary="Extend an unexpired hold (bumps its version)",
    description=(
        "Moves a held, unexpired hold's `expires_at` to `ttl_seconds` from now (default: the "
        "server's default TTL) and bumps its version. Another change since `expected_version`: "
        "409 `stale_version`; expired: 409 `hold_expired`."
    ),
    tags=["Holds"],
    operation_id="renew_hold",
    url_name="renew-hold",
    openapi_extra=_body(RenewRequest),
)
@_answers()
def renew_hold(request: HttpRequest, hold_id: int = HoldId, key: str | None = Key) -> HttpResponse:
    return _hold_change(
        request,
        _principal(request),
        hold_id,
        _HOLD,
        _RENEW_FIELDS,
        lambda data: partial(services.renew, hold_id, _expected_version(data), _ttl(data)),
    )


@api.post(
    CONFIRM,
    response={**_CHANGE_RESPONSES, **_ALWAYS},
    summary="Turn an unexpired hold into a confirmed seat",
    description=(
        "The seat becomes the holder's for good (status `confirmed`). The hold must be held, "
        "unexpired and at `expected_version`."
    ),
    tags=["Holds"],
    operation_id="confirm_hold",
    url_name="confirm-hold",
    openapi_extra=_body(VersionRequest),
)
@_answers()
def confirm_hold(
    request: HttpRequest, hold_id: int = HoldId, key: str | None = Key
) -> HttpResponse:
    return _versioned_change(request, hold_id, services.confirm)


@api.post(
    CANCEL,
    response={**_CHANGE_RESPONSES, **_ALWAYS},
    summary="Give the seat back",
    description="Cancels a held hold at `expected_version`: its seat is free again at once.",
    tags=["Holds"],
    operation_id="cancel_hold",
    url_name="cancel-hold",
    openapi_extra=_body(VersionRequest),
)
@_answers()
def cancel_hold(request: HttpRequest, hold_id: int = HoldId, key: str | None = Key) -> HttpResponse:
    return _versioned_change(request, hold_id, services.cancel)


def _versioned_change(
    request: HttpRequest, hold_id: int, change: Callable[[int, int], Reservation]
) -> HttpResponse:
    """confirm/cancel: the body carries only the version the client saw."""
    return _hold_change(
        request,
        _principal(request),
        hold_id,
        _HOLD,
        _VERSION_FIELDS,
        lambda data: partial(change, hold_id, _expected_version(data)),
    )


# A method a path does not take: 405 with Allow, after authentication as before any other
# answer (not in the document: schemathesis checks such methods are refused).
def _refuse_other_methods(path: str, allowed: list[str], id_name: str | None) -> None:
    allow = {"Allow": ", ".join(sorted(allowed))}

    def refuse(request: HttpRequest) -> HttpResponse:
        raise ApiError(
            405, "method_not_allowed", f"method {request.method} is not allowed here", headers=allow
        )

    if id_name == "offering_id":

        def by_offering(request: HttpRequest, offering_id: int) -> HttpResponse:
            return refuse(request)

        view: View = by_offering
    elif id_name == "hold_id":

        def by_hold(request: HttpRequest, hold_id: int) -> HttpResponse:
            return refuse(request)

        view = by_hold
    else:

        def plain(request: HttpRequest) -> HttpResponse:
            return refuse(request)

        view = plain
    view.__name__ = "refuse_" + re.sub(r"\W+", "_", path.replace("{int:", "")).strip("_")
    api.api_operation(
        [m for m in _EVERY_METHOD if m not in allowed],
        path,
        include_in_schema=False,
        operation_id=view.__name__,
    )(_answers(check_scope=False)(view))


# Every path answers the methods its operations take; any other, 405 with them in Allow.
for _path, _path_view in list(api.default_router.path_operations.items()):
    _taken = sorted({method for operation in _path_view.operations for method in operation.methods})
    _ids = re.findall(r"\{int:(\w+)\}", _path)
    _refuse_other_methods(_path, _taken, _ids[0] if _ids else None)


@csrf_exempt
def no_such_path(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Every path under the API that no operation has, whatever the method: a problem, never
    Django's HTML page (and no credentials needed to learn that a path does not exist)."""
    response = ApiError(404, "not_found", f"no operation has the path {request.path}").response(
        request
    )
    response[problems.REQUEST_ID_HEADER] = problems.request_id_of(request)
    return response
