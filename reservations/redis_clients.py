"""One Redis client per URL (and timeout) per process, safe to use in a process forked from a
threaded one: the cleanup's direct readers and counters, and the API's rate limiter.

A Celery worker's main process runs threads that use Redis (the autoscaler's reader samples the
release queue), and it forks pool processes while those threads run (autoscaling, replacing a
process after ``max_tasks_per_child`` or a crash). redis-py (8.1) resets an inherited connection
pool on first use in the child, and that reset takes the pool's lock first: when a parent thread
held the lock at the instant of the fork, the child waits for it forever. Every sweep that child
ran then stopped at its first queue-depth read until the soft time limit; that shard's holds were
never released (docs/LIBRARY-NOTES.md, "redis-py after fork").

So a child never touches a client it inherited: after every fork the child starts with no
clients and builds its own. The inherited clients are kept referenced, not dropped: dropping
them would let the garbage collector run their ``__del__``, which goes through the same lock.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.sentinel import Sentinel

from reservations import redis_sentinel

# How long a client waits to connect and for an answer, unless its caller asks for less (the
# API's rate limiter, on the request's path, waits half a second).
TIMEOUT_SECONDS = 5.0

_clients: dict[tuple[str, float], redis.Redis] = {}
# The parent's clients as a child inherited them: referenced, never used (see above).
_inherited: list[redis.Redis] = []


def client(url: str, *, timeout: float = TIMEOUT_SECONDS) -> redis.Redis:
    """This process's client for ``url`` with ``timeout`` (created on first use; connects
    lazily): a ``redis://`` or ``rediss://`` URL's server, or the master a ``sentinel://`` URL's
    sentinels name."""
    found = _clients.get((url, timeout))
    if found is None:
        # No lock: a lock here could itself be inherited held. Two threads racing create two
        # clients and keep one; the other never connected.
        made = _sentinel_master(url, timeout)
        found = _clients.setdefault(
            (url, timeout), made if made is not None else _direct(url, timeout)
        )
    return found


def _direct(url: str, timeout: float) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, **_tls(url)
    )


def _sentinel_master(url: str, timeout: float) -> redis.Redis | None:
    """For a ``sentinel://`` URL, a client of the master the sentinels name now: redis-py's
    ``SentinelConnectionPool`` asks them again whenever it opens a connection, so after a
    failover the next command reaches the new master, with no restart. ``None`` otherwise."""
    if not redis_sentinel.is_sentinel(url):
        return None
    from django.conf import settings  # noqa: PLC0415 - read when a client is made, not at import

    # Checked at start-up (the settings call reservations.redis_sentinel.check); the name given is
    # not the URL, which may carry a password.
    target = redis_sentinel.parse(
        "a sentinel:// URL", url, getattr(settings, redis_sentinel.MASTER_VARIABLE, "")
    )
    timeouts = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    sentinels = Sentinel(list(target.nodes), sentinel_kwargs=dict(timeouts), **timeouts)
    return sentinels.master_for(
        target.master,
        db=target.db,
        username=target.username,
        password=target.password,
        **timeouts,
    )


def _tls(url: str) -> dict[str, Any]:
    """The TLS options of a rediss:// URL that does not carry them in its query: the
    ``REDIS_TLS_*`` settings, as the settings module parsed and checked them."""
    if not url.startswith("rediss://") or "ssl_" in urlsplit(url).query:
        return {}
    from django.conf import settings  # noqa: PLC0415 - read when a client is made, not at import

    return dict(getattr(settings, "REDIS_TLS_OPTIONS", {}))


def _forget_inherited_clients() -> None:
    _inherited.extend(_clients.values())
    _clients.clear()


os.register_at_fork(after_in_child=_forget_inherited_clients)
