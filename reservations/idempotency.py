"""``Idempotency-Key``: a POST retried under the same key gets the first attempt's response
instead of a second effect.

A key belongs to one principal (reservations.clients): two clients may use the same key
without meeting. The key's row is inserted in the same transaction as the change it guards
and holds the response that change produced, so the two commit or roll back together:

- the first request under a key inserts the row, runs the change and stores its response;
- a retry finds the row, checks that it is the same request (method, path and body, by
  hash) and replays the stored status, body and headers; a different request is refused
  (``IdempotencyKeyReused``);
- a request arriving while the first is still running waits on the row's unique index until
  that transaction ends, then replays its response, or runs itself if the first rolled back
  (a transient database error: nothing happened, nothing was stored).

Responses to domain refusals (no seats, stale version, ...) are stored and replayed like
successes: the key names one attempt and its answer. Requests refused before the change ran
(invalid body, unknown hold, missing scope) store nothing. A key lives
``RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS``; after that it is as good as new, and the
cleanup's prune deletes it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, transaction

from . import conf, sql
from .errors import ReservationError
from .services import TransientConflict

HEADER = "Idempotency-Key"
# Printable ASCII without spaces, as keys are usually UUIDs or random strings; the length is
# the column's.
KEY_PATTERN = re.compile(r"[\x21-\x7e]{1,255}")
PRUNE_BATCH = 1000


class InvalidIdempotencyKey(ReservationError):
    code = "invalid_idempotency_key"


class IdempotencyKeyReused(ReservationError):
    """The key was used for a different request (another path or body)."""

    code = "idempotency_key_reused"


@dataclass(frozen=True)
class Response:
    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)
    replayed: bool = False


def check_key(value: str) -> str:
    if not KEY_PATTERN.fullmatch(value):
        raise InvalidIdempotencyKey(
            f"{HEADER} must be 1 to 255 printable ASCII characters without spaces"
        )
    return value


def request_hash(method: str, path: str, body: Mapping[str, Any]) -> str:
    """The same request hashes the same however its JSON was spelled (key order, spaces)."""
    canonical = json.dumps(
        [method, path, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def run_once(
    client_id: int | None, key: str, fingerprint: str, produce: Callable[[], Response]
) -> Response:
    """``produce()``'s response, produced at most once per ``(client_id, key)`` while the key
    lives. ``produce`` runs inside this function's transaction; if it raises, nothing is
    stored and the key stays free."""
    params = {
        "client": client_id,
        "key": key,
        "hash": fingerprint,
        "ttl": conf.value("RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS"),
    }
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(sql.DELETE_EXPIRED_IDEMPOTENCY_KEY, params)
            cur.execute(sql.CLAIM_IDEMPOTENCY_KEY, params)
            claimed = cur.fetchone()
            if claimed is None:
                cur.execute(sql.STORED_IDEMPOTENT_RESPONSE, params)
                stored = cur.fetchone()
        if claimed is None:
            return _replay(key, fingerprint, stored)
        response = produce()
        with connection.cursor() as cur:
            cur.execute(
                sql.STORE_IDEMPOTENT_RESPONSE,
                {
                    "id": claimed[0],
                    "status": response.status,
                    "body": json.dumps(response.body),
                    "headers": json.dumps(dict(response.headers)),
                },
            )
    return response


def _replay(key: str, fingerprint: str, stored: tuple[Any, ...] | None) -> Response:
    if stored is None:
        # Inserted nothing, yet nothing is there: the row was deleted in between (it expired
        # and was pruned). Transient: the API answers 503 with Retry-After.
        raise TransientConflict(f"{HEADER} {key!r} changed while this request ran")
    stored_hash, status, body, headers = stored
    if stored_hash != fingerprint:
        raise IdempotencyKeyReused(
            f"{HEADER} {key!r} was already used for a different request; use a new key"
        )
    return Response(status, _json(body), _json(headers), replayed=True)


def _json(value: Any) -> Any:
    # psycopg returns jsonb decoded; a plain cursor on another adapter might not.
    return json.loads(value) if isinstance(value, str) else value


def prune_expired(batch: int = PRUNE_BATCH) -> int:
    """Delete expired keys, a batch per statement, until none is left; returns how many."""
    total = 0
    while True:
        with connection.cursor() as cur:
            cur.execute(sql.PRUNE_IDEMPOTENCY_KEYS, {"batch": batch})
            deleted = cur.rowcount
        total += deleted
        if deleted < batch:
            return total
