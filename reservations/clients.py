"""API clients: their tokens, what each may do, and the holds each may see.

A request authenticates as a ``Principal``: an ``ApiClient`` found by its token's digest, or
the local development token (``RESERVATIONS_API_TOKEN``, refused by the production settings),
which acts as a client of its own with every scope and no rate limit. A hold belongs to the
principal that created it; to any other its id does not exist.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from django.db import connection
from django.utils import timezone

from . import conf, sql
from .models import ApiClient, ApiToken, Reservation, ReservationQuerySet

TOKEN_PREFIX = "rsv_"
# The first characters of a token, stored to tell tokens apart (the rest is secret).
SHOWN_PREFIX_LENGTH = 12
# A token's last use is recorded to this precision: at most one write per token per interval.
LAST_USED_PRECISION_SECONDS = 60


@dataclass(frozen=True)
class Principal:
    """Who a request is from, and what it may do."""

    client_id: int | None  # None: the local development token
    name: str
    can_read: bool
    can_write: bool
    all_offerings: bool
    requests_per_minute: int | None = None  # None: not limited


DEVELOPMENT_PRINCIPAL = Principal(
    client_id=None, name="development token", can_read=True, can_write=True, all_offerings=True
)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue_token(client: ApiClient) -> str:
    """A new token for ``client``. The return value is the only time the token exists in
    clear: only its digest is stored."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    ApiToken.objects.create(client=client, prefix=token[:SHOWN_PREFIX_LENGTH], digest=digest(token))
    return token


def revoke_tokens(tokens: list[ApiToken] | None = None, *, ids: list[int] | None = None) -> int:
    """Revoke tokens (by instance or id); a revoked token is refused from the next request on.
    Returns how many were still valid."""
    wanted = [t.pk for t in tokens or []] + list(ids or [])
    return ApiToken.objects.filter(pk__in=wanted, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )


def authenticate(token: str) -> Principal | None:
    """The principal ``token`` names, or None. A read; the token's last use is written when
    the recorded one is over ``LAST_USED_PRECISION_SECONDS`` old. (The rate limit is
    ``reservations.ratelimit``'s.)"""
    shared = conf.value("RESERVATIONS_API_TOKEN")
    # compare_digest on bytes: on str it raises TypeError for non-ASCII input.
    if shared and hmac.compare_digest(token.encode(), shared.encode()):
        return DEVELOPMENT_PRINCIPAL
    if not token.startswith(TOKEN_PREFIX):
        return None
    with connection.cursor() as cur:
        cur.execute(
            sql.AUTHENTICATE_TOKEN,
            {"digest": digest(token), "touch": LAST_USED_PRECISION_SECONDS},
        )
        row = cur.fetchone()
        if row is None:
            return None
        client_id, name, can_read, can_write, all_offerings, limit, token_id, stale = row
        if stale:
            cur.execute(sql.TOUCH_TOKEN, {"token": token_id, "touch": LAST_USED_PRECISION_SECONDS})
    return Principal(client_id, name, can_read, can_write, all_offerings, limit)


def may_use_offering(principal: Principal, offering_id: int) -> bool:
    if principal.all_offerings or principal.client_id is None:
        return True
    return ApiClient.offerings.through.objects.filter(
        apiclient_id=principal.client_id, offering_id=offering_id
    ).exists()


def owned_holds(principal: Principal) -> ReservationQuerySet:
    """The holds ``principal`` created (for the development token: holds of no client) on
    offerings it may still use."""
    if principal.client_id is None:
        return Reservation.objects.filter(client__isnull=True)
    holds = Reservation.objects.filter(client_id=principal.client_id)
    if not principal.all_offerings:
        holds = holds.filter(offering__api_clients=principal.client_id)
    return holds


def owned_hold(principal: Principal, hold_id: int) -> Reservation | None:
    """The hold if ``principal`` created it and may still use its offering, else None."""
    return owned_holds(principal).filter(pk=hold_id).first()


# --- listings, by cursor ------------------------------------------------------------------------


class InvalidCursor(ValueError):
    pass


# A cursor: the last id seen, as 8 bytes in base64url without padding. Every string of this
# shape is a cursor (the document states the shape), so a well-formed one is never refused: one
# naming an id past the last continues after it, with an empty page.
CURSOR_PATTERN = re.compile(r"[A-Za-z0-9_-]{11}")
_MAX_ID = 2**63 - 1


def encode_cursor(after_id: int) -> str:
    return base64.urlsafe_b64encode(after_id.to_bytes(8, "big")).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """The id a cursor continues after; ``InvalidCursor`` for a string of another shape.

    Cursors of the earlier form (base64url of ``after:<id>``), handed out before an upgrade,
    are still read, so a client paging through a listing then goes on."""
    if CURSOR_PATTERN.fullmatch(cursor):
        earlier = _earlier_cursor(cursor)
        if earlier is not None:
            return earlier
        after = int.from_bytes(base64.urlsafe_b64decode(cursor + "="), "big")
        return min(after, _MAX_ID)
    earlier = _earlier_cursor(cursor)
    if earlier is None:
        raise InvalidCursor(cursor)
    return earlier


def _earlier_cursor(cursor: str) -> int | None:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    kind, _, number = text.partition(":")
    if kind != "after" or not number.isascii() or not number.isdigit():
        return None
    if not 0 < int(number) < 2**63:
        return None
    return int(number)


@dataclass(frozen=True)
class Page:
    holds: list[Reservation]
    next_cursor: str | None


def list_holds(
    principal: Principal,
    *,
    holder: str | None = None,
    offering_id: int | None = None,
    after_id: int = 0,
    limit: int,
) -> Page:
    """The principal's holds of one holder or one offering, in id order after ``after_id``.
    Ids only grow, so a hold made while a client pages appears on a later page, never twice."""
    holds = owned_holds(principal).filter(pk__gt=after_id)
    if holder is not None:
        holds = holds.filter(holder=holder)
    if offering_id is not None:
        holds = holds.filter(offering_id=offering_id)
    found = list(holds.order_by("pk")[: limit + 1])
    more = len(found) > limit
    found = found[:limit]
    return Page(found, encode_cursor(found[-1].pk) if more else None)
