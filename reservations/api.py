"""Thin JSON views over ``reservations.services``: authenticate, parse and validate, call the
service, serialize. Every user-input failure is a JSON 4xx; nothing a client sends yields a 500.

Errors are RFC 9457 problem details (``reservations.problems``): ``type``, ``title``, ``status``,
``detail``, ``instance``, and the stable ``code``, the ``field`` at fault and the ``request_id``.

Who may do what is ``reservations.clients`` (tokens, scopes, offerings, rate limits, which holds
a client sees); a POST under an ``Idempotency-Key`` runs through ``reservations.idempotency``.
docs/API.md describes the whole surface.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import partial, wraps
from typing import Any, TypeVar

from django.db import OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt

from . import clients, conf, idempotency, problems, ratelimit, services
from .clients import Principal
from .errors import (
    InvalidTtl,
    NoSeatsAvailable,
    NotHeld,
    OfferingNotFound,
    ReservationError,
    ReservationExpired,
    ReservationNotFound,
    StaleVersion,
)
from .models import Offering, Reservation
from .retry import call_with_retries, is_transient_db_error

logger = logging.getLogger(__name__)

T = TypeVar("T")
View = Callable[..., HttpResponse]

# Ids and versions live in bigint / integer columns; anything larger cannot exist.
MAX_ID = 2**63 - 1
MAX_VERSION = 2**31 - 1
HOLDER_MAX_LENGTH = Reservation._meta.get_field("holder").max_length or 200

# After the retries (reservations.retry) the client is told to come back (503 + Retry-After).
RETRY_AFTER_SECONDS = 1

_CONFLICTS = (NoSeatsAvailable, StaleVersion, NotHeld, ReservationExpired)
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


def _authenticate(request: HttpRequest) -> Principal:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    principal = None
    if scheme.lower() == "bearer" and token:
        principal = clients.authenticate(token)
    if principal is None:
        raise ApiError(
            401,
            "unauthorized",
            "missing or invalid bearer token",
            headers={"WWW-Authenticate": 'Bearer realm="reservations"'},
        )
    return principal


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


def api_view(*methods: str) -> Callable[[View], View]:
    """Token auth, method check, scope check and error translation around a view, which is
    called with the request's ``Principal`` after the request."""
    allowed = set(methods)
    if "GET" in allowed:
        allowed.add("HEAD")

    def decorator(view: View) -> View:
        @csrf_exempt
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            request_id = problems.request_id_of(request)
            response = _answer(request, *args, **kwargs)
            response[problems.REQUEST_ID_HEADER] = request_id
            decision = getattr(request, _RATE_LIMIT_ATTRIBUTE, None)
            if decision is not None:
                for name, value in decision.headers().items():
                    response[name] = value
            return response

        def _answer(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                principal = _authenticate(request)
                _count_request(request, principal)
                if request.method not in allowed:
                    raise ApiError(
                        405,
                        "method_not_allowed",
                        f"method {request.method} is not allowed here",
                        headers={"Allow": ", ".join(sorted(allowed))},
                    )
                _require_scope(principal, request.method or "")
                return view(request, principal, *args, **kwargs)
            except ApiError as exc:
                return exc.response(request)
            except ReservationError as exc:
                return problems.answer(request, *_domain_error(request, exc))
            except (OperationalError, services.TransientConflict) as exc:
                if not is_transient_db_error(exc):
                    raise
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
            except Exception:
                # Without ApiRequestMiddleware too, an API answer is never Django's HTML 500.
                logger.exception("unhandled error in an API request", extra={"path": request.path})
                return problems.problem(
                    request,
                    500,
                    "internal_error",
                    problems.PROBLEM_TYPES["internal_error"].description,
                )

        return wrapper

    return decorator


# --- views ---------------------------------------------------------------------------------

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


def _create_hold(request: HttpRequest, principal: Principal, offering_id: int) -> HttpResponse:
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


@api_view("GET", "POST")
def offering_holds(request: HttpRequest, principal: Principal, offering_id: int) -> HttpResponse:
    """POST: hold a seat (201 with ``Location``). GET: the offering's holds, by cursor."""
    if request.method == "POST":
        return _create_hold(request, principal, offering_id)
    _check_id(offering_id, *_OFFERING)
    _check_access(principal, offering_id, _OFFERING)
    if not Offering.objects.filter(pk=offering_id).exists():
        raise OfferingNotFound(f"offering {offering_id} does not exist")
    return _page(request, principal, frozenset(), offering_id=offering_id)


@api_view("GET")
def holds(request: HttpRequest, principal: Principal) -> HttpResponse:
    """A holder's holds (``?holder=``, required), by cursor."""
    if "holder" not in request.GET:
        raise ApiError(400, "missing_field", "holder is required", field="holder")
    return _page(request, principal, frozenset({"holder"}), holder=_holder(request.GET))


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


@api_view("GET")
def hold_detail(request: HttpRequest, principal: Principal, hold_id: int) -> HttpResponse:
    _check_id(hold_id, *_HOLD)
    hold = clients.owned_hold(principal, hold_id)
    if hold is None:
        raise ReservationNotFound(f"hold {hold_id} does not exist")
    return JsonResponse(hold_json(hold))


@api_view("POST")
def renew_hold(request: HttpRequest, principal: Principal, hold_id: int) -> HttpResponse:
    return _hold_change(
        request,
        principal,
        hold_id,
        _HOLD,
        _RENEW_FIELDS,
        lambda data: partial(services.renew, hold_id, _expected_version(data), _ttl(data)),
    )


def _versioned_change(
    request: HttpRequest,
    principal: Principal,
    hold_id: int,
    change: Callable[[int, int], Reservation],
) -> HttpResponse:
    """confirm/cancel: the body carries only the version the client saw."""
    return _hold_change(
        request,
        principal,
        hold_id,
        _HOLD,
        _VERSION_FIELDS,
        lambda data: partial(change, hold_id, _expected_version(data)),
    )


@api_view("POST")
def confirm_hold(request: HttpRequest, principal: Principal, hold_id: int) -> HttpResponse:
    return _versioned_change(request, principal, hold_id, services.confirm)


@api_view("POST")
def cancel_hold(request: HttpRequest, principal: Principal, hold_id: int) -> HttpResponse:
    return _versioned_change(request, principal, hold_id, services.cancel)


@api_view("GET")
def offering_availability(
    request: HttpRequest, principal: Principal, offering_id: int
) -> HttpResponse:
    _check_id(offering_id, *_OFFERING)
    _check_access(principal, offering_id, _OFFERING)
    return JsonResponse(services.availability(offering_id))


@csrf_exempt
def no_such_path(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Every path under the API that no operation has, whatever the method: a problem, never
    Django's HTML page (and no credentials needed to learn that a path does not exist)."""
    response = ApiError(404, "not_found", f"no operation has the path {request.path}").response(
        request
    )
    response[problems.REQUEST_ID_HEADER] = problems.request_id_of(request)
    return response
