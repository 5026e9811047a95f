"""Each API client's rate limit: a sliding window in Redis, with no database write per request.

A client may make ``requests_per_minute`` requests in **any** 60 seconds (not per calendar
minute): every allowed request is an entry of a sorted set, scored by its time. One Lua script
drops the entries older than the window, counts the rest, and adds the new one only when the
count is under the limit; Redis runs a script alone, so concurrent requests, from any process
or host, can never be allowed past the limit. The time is Redis's own (``TIME``), so the web
hosts' clocks do not matter.

When Redis cannot be reached the limiter **fails open**: the request is answered, a warning
is logged (at most once per ``OUTAGE_RETRY_SECONDS`` per process) and the counter
``reservations_api_rate_limiter_failures`` counts it; for ``OUTAGE_RETRY_SECONDS`` after a
failure the limiter does not try Redis again, so an outage costs requests no timeouts.
docs/API.md says why it fails open.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass

import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from prometheus_client import Counter

from . import conf, redis_clients

logger = logging.getLogger(__name__)

WINDOW_SECONDS = 60
POLICY_NAME = "default"
KEY_PREFIX = "reservations:api-rate:"
# After a failure, requests go unlimited for this long before Redis is tried again.
OUTAGE_RETRY_SECONDS = 5.0

# Counted by the web processes, which serve the API (gunicorn.conf.py prepares prometheus_client's
# multiprocess mode before any module is imported); nothing else imports this module.
FAILURES = Counter(
    "reservations_api_rate_limiter_failures",
    "API requests answered without a rate-limit check because the limiter's Redis failed",
)

# KEYS[1]: the client's set. ARGV: window (ms), limit, a unique member.
# Returns {allowed (1/0), requests counted in the window (this one included when allowed),
#          ms until the oldest counted request leaves the window}.
_SCRIPT = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local window = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
local allowed = 0
if count < limit then
    redis.call('ZADD', KEYS[1], now, now .. ':' .. ARGV[3])
    redis.call('PEXPIRE', KEYS[1], window)
    count = count + 1
    allowed = 1
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local reset = window
if oldest[2] then
    reset = tonumber(oldest[2]) + window - now
end
return {allowed, count, reset}
"""


@dataclass(frozen=True)
class Decision:
    """What the limiter decided, and the RateLimit header fields that tell the client."""

    allowed: bool
    limit: int
    remaining: int
    reset_seconds: int  # until the oldest counted request leaves the window (a slot frees)

    def headers(self) -> dict[str, str]:
        found = {
            "RateLimit-Policy": f'"{POLICY_NAME}";q={self.limit};w={WINDOW_SECONDS}',
            "RateLimit": f'"{POLICY_NAME}";r={self.remaining};t={self.reset_seconds}',
        }
        if not self.allowed:
            found["Retry-After"] = str(self.reset_seconds)
        return found


def redis_url() -> str:
    """``RESERVATIONS_API_RATE_LIMIT_REDIS_URL``, else the cleanup's counter Redis (the
    broker's when it is Redis, a ``sentinel://`` one included); empty: no Redis, no limit (a
    system check warns). A ``sentinel://`` URL reaches the master its sentinels name, the one
    ``CELERY_BROKER_SENTINEL_MASTER`` names, and follows it after a failover
    (``reservations.redis_clients``)."""
    stated = str(conf.value("RESERVATIONS_API_RATE_LIMIT_REDIS_URL"))
    if stated:
        return stated
    return str(getattr(settings, "CLEANUP_COUNTER_REDIS_URL", ""))


# Timeouts short enough that a Redis that stopped answering costs a request half a second once,
# then nothing for OUTAGE_RETRY_SECONDS.
TIMEOUT_SECONDS = 0.5


_down_until = 0.0


def check(client_id: int, limit: int) -> Decision | None:
    """Count a request of ``client_id`` against ``limit`` per window. ``None`` when the limiter
    could not decide (no Redis configured, or Redis failing): the request goes ahead."""
    global _down_until
    url = redis_url()
    if not url or time.monotonic() < _down_until:
        if url:
            FAILURES.inc()
        return None
    try:
        allowed, count, reset_ms = redis_clients.client(url, timeout=TIMEOUT_SECONDS).eval(
            _SCRIPT, 1, f"{KEY_PREFIX}{client_id}", WINDOW_SECONDS * 1000, limit, uuid.uuid4().hex
        )
    except (redis.RedisError, OSError, ImproperlyConfigured) as exc:
        FAILURES.inc()
        _down_until = time.monotonic() + OUTAGE_RETRY_SECONDS
        logger.warning(
            "API rate limiter unavailable: requests are not limited for the next %s s",
            OUTAGE_RETRY_SECONDS,
            extra={"error": type(exc).__name__},
        )
        return None
    return Decision(
        allowed=bool(allowed),
        limit=limit,
        remaining=max(0, limit - int(count)),
        reset_seconds=max(1, math.ceil(int(reset_ms) / 1000)),
    )
