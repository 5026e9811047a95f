"""Transient database errors and retrying a one-transaction service call after one.

Used by the JSON API and the admin: a deadlock or serialization failure rolled the whole
transaction back, so calling the service again is safe.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg.errors
from django.db import OperationalError

from . import services

logger = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_ATTEMPTS = 3
TRANSIENT_BACKOFF_SECONDS = 0.05


def is_transient_db_error(exc: BaseException) -> bool:
    """A deadlock or serialization failure (Django surfaces both as ``OperationalError``), or a
    conditional update that raced a concurrent change (``services.TransientConflict``)."""
    if isinstance(exc, services.TransientConflict):
        return True
    if isinstance(exc, OperationalError):
        cause = exc.__cause__
        return isinstance(
            cause, (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
        )
    return False


def call_with_retries(
    func: Callable[[], T],
    *,
    attempts: int = TRANSIENT_ATTEMPTS,
    backoff: float = TRANSIENT_BACKOFF_SECONDS,
) -> T:
    """Call ``func``; on a transient database error call it again (up to ``attempts`` times in
    all, with jittered exponential backoff), then re-raise the last error.

    Only for service calls that are one transaction each: a deadlock rolled it back entirely.
    """
    for attempt in range(1, attempts + 1):
        try:
            return func()
        except (OperationalError, services.TransientConflict) as exc:
            if not is_transient_db_error(exc) or attempt == attempts:
                raise
            logger.warning(
                "transient database error, retrying",
                extra={"attempt": attempt, "error": type(exc.__cause__ or exc).__name__},
            )
            time.sleep(random.uniform(0, backoff * 2 ** (attempt - 1)))
    raise AssertionError("unreachable")  # pragma: no cover
