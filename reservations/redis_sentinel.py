"""Redis Sentinel (``sentinel://``): the URL form, the master's name, and what is refused.

kombu's form lists every sentinel, separated by ``;``, and takes the master's name from a
transport option::

    CELERY_BROKER_URL='sentinel://:PASSWORD@s1:26379/0;sentinel://s2:26379/0;sentinel://s3:26379/0'
    CELERY_BROKER_SENTINEL_MASTER=mymaster

The password and database number of the *first* entry are the master's (kombu reads only that
one; the sentinels themselves are asked without a password). The same two settings serve every
direct Redis client of the project (queue readers, delivery counters, autoscaler readings:
``reservations.redis_clients``), which ask the sentinels for the master the same way and follow it
after a failover.

Refused at start-up, naming the variable: a Sentinel URL without a master name, a master name
without a Sentinel URL, an entry of another scheme mixed in, an entry without a host, any query
option (kombu and redis-py would read them differently, and TLS to Sentinel is not screened or
tested here), and ``REDIS_TLS_*`` settings that no ``rediss://`` URL would use.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

SCHEME = "sentinel://"
DEFAULT_PORT = 26379
MASTER_VARIABLE = "CELERY_BROKER_SENTINEL_MASTER"


def is_sentinel(url: str) -> bool:
    return url.startswith(SCHEME)


@dataclass(frozen=True)
class SentinelTarget:
    """What a client needs to reach the master: the sentinels, the master's name, and the
    master's database, user and password (from the first entry, as kombu reads them)."""

    nodes: tuple[tuple[str, int], ...]
    master: str
    db: int
    username: str | None
    password: str | None


def parse(variable: str, url: str, master: str) -> SentinelTarget:
    """The sentinels of a ``sentinel://`` URL; anything kombu would read otherwise, or that
    the project does not support, fails here naming ``variable``."""
    if not master:
        raise ImproperlyConfigured(
            f"{variable} is a sentinel:// URL but {MASTER_VARIABLE} is not set: name the "
            "master the sentinels monitor (their `sentinel monitor NAME ...` line)"
        )
    nodes: list[tuple[str, int]] = []
    db, username, password = 0, None, None
    for number, entry in enumerate(url.split(";"), 1):
        where = f"{variable} (entry {number})"
        if not is_sentinel(entry):
            raise ImproperlyConfigured(
                f"{where}: every entry of a Sentinel URL must be sentinel://host:port, not "
                f"{entry.partition('://')[0]!r}://"
            )
        parts = urlsplit(entry)
        if parts.query or parts.fragment:
            raise ImproperlyConfigured(
                f"{where}: options in a sentinel:// URL are not supported (TLS to Sentinel is "
                "not screened or tested by this project)"
            )
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError:
            raise ImproperlyConfigured(f"{where}: the port is not a number") from None
        if not parts.hostname:
            raise ImproperlyConfigured(f"{where}: no host")
        nodes.append((parts.hostname, port))
        if number == 1:
            path = parts.path.strip("/")
            if path and not path.isdigit():
                raise ImproperlyConfigured(f"{where}: the database {path!r} is not a number")
            db = int(path or 0)
            username = unquote(parts.username) if parts.username else None
            password = unquote(parts.password) if parts.password else None
    return SentinelTarget(tuple(nodes), master, db, username, password)


def check(broker_url: str, counter_url: str, master: str, tls_settings: list[str]) -> None:
    """Start-up checks across the settings (see the module's docstring)."""
    urls = {"CELERY_BROKER_URL": broker_url, "CLEANUP_COUNTER_REDIS_URL": counter_url}
    sentinel = [name for name, url in urls.items() if is_sentinel(url)]
    if master and not sentinel:
        raise ImproperlyConfigured(
            f"{MASTER_VARIABLE} is set but neither CELERY_BROKER_URL nor "
            "CLEANUP_COUNTER_REDIS_URL is a sentinel:// URL"
        )
    for name in sentinel:
        parse(name, urls[name], master)
    if sentinel and tls_settings and not any(u.startswith("rediss://") for u in urls.values()):
        raise ImproperlyConfigured(
            f"{', '.join(tls_settings)} {'is' if len(tls_settings) == 1 else 'are'} set but "
            f"{sentinel[0]} is a sentinel:// URL: TLS to Sentinel is not supported"
        )
