"""Strict readers for settings that come from the environment.

Every helper raises ``ImproperlyConfigured`` naming the variable, so a bad value fails at
start-up instead of at 3 a.m. (healthchecks' ``envbool`` is the model).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_MISSING = object()

# Values the development and test settings fill in; production refuses every one of them.
DEVELOPMENT_VALUES: dict[str, frozenset[str]] = {
    "SECRET_KEY": frozenset({"local-dev-only-not-secret", "test-only-not-secret"}),
    # scripts/run.sh's local login (README) and .env.example's placeholder.
    "FLOWER_BASIC_AUTH": frozenset({"admin:admin", "admin:change-me-flower"}),
}
# Passwords published with the project: the README's local logins, docs/CONFIGURATION.md's
# RabbitMQ example (guest is also RabbitMQ's built-in account), .env.example's placeholders
# (every "change-me…" value, see EXAMPLE_MARKER) and deploy/k8s's "<password>". Production
# refuses each of them in FLOWER_BASIC_AUTH and in the password of any URL setting.
EXAMPLE_PASSWORDS: frozenset[str] = frozenset(
    {
        "admin",
        "guest",
        "change-me-flower",
        "change-me-postgres",
        "change-me-redis",
        "<password>",
    }
)
# scripts/make_env.py replaces every .env.example value containing this; one left in place is
# an example value.
EXAMPLE_MARKER = "change-me"
_TRUE = {"1", "true"}
_FALSE = {"0", "false"}


def _raw(name: str, default: object) -> str | None:
    value = os.environ.get(name)
    if value is None or value == "":
        if default is _MISSING:
            raise ImproperlyConfigured(f"{name} must be set (no default outside local development)")
        return None
    return value


def env_str(name: str, default: object = _MISSING) -> str:
    value = _raw(name, default)
    return str(default) if value is None else value


def env_bool(name: str, default: object = _MISSING) -> bool:
    value = _raw(name, default)
    if value is None:
        return bool(default)
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean; use true/false or 1/0")


def env_int(name: str, default: object = _MISSING, *, minimum: int | None = None) -> int:
    value = _raw(name, default)
    if value is None:
        result = int(default)  # type: ignore[call-overload]
    else:
        try:
            result = int(value)
        except ValueError:
            raise ImproperlyConfigured(f"{name}={value!r} is not an integer") from None
    if minimum is not None and result < minimum:
        raise ImproperlyConfigured(f"{name}={result} must be >= {minimum}")
    return result


def env_float(name: str, default: object = _MISSING, *, minimum: float | None = None) -> float:
    value = _raw(name, default)
    if value is None:
        result = float(default)  # type: ignore[arg-type]
    else:
        try:
            result = float(value)
        except ValueError:
            raise ImproperlyConfigured(f"{name}={value!r} is not a number") from None
    if minimum is not None and result < minimum:
        raise ImproperlyConfigured(f"{name}={result} must be >= {minimum}")
    return result


def env_list(name: str, default: object = _MISSING) -> list[str]:
    value = _raw(name, default)
    if value is None:
        return list(default)  # type: ignore[call-overload]
    return [item.strip() for item in value.split(",") if item.strip()]


def env_typed(name: str, kind: type, default: object) -> object:
    """The variable read by the helper for ``kind`` (``str``, ``int``, ``float``, ``bool``, or
    ``tuple``: a comma-separated list); how ``cleanup.conf.CleanupSettings`` is read. Bounds
    are the settings object's to check."""
    if kind is tuple:
        return tuple(env_list(name, default))
    readers: dict[type, Callable[[str, object], object]] = {
        str: env_str,
        int: env_int,
        float: env_float,
        bool: env_bool,
    }
    if kind not in readers:
        raise TypeError(f"{name}: no reader for settings of type {kind.__name__}")
    return readers[kind](name, default)


# libpq's target_session_attrs values. Every process here writes, so a URL naming several hosts
# must pick the writable one: without it libpq takes the first that answers, a standby after a
# failover, and every write fails with "cannot execute ... in a read-only transaction".
SESSION_ATTRS = frozenset(
    {"any", "read-write", "read-only", "primary", "standby", "prefer-standby"}
)
WRITABLE_SESSION_ATTRS = frozenset({"read-write", "primary"})
# Seconds libpq waits on each host of a multi-host URL before it tries the next. Without a bound
# a primary that drops packets holds every connection for the kernel's TCP timeout (minutes).
MULTI_HOST_CONNECT_TIMEOUT = "5"


def _host_and_port(name: str, entry: str, position: int, count: int) -> tuple[str, str]:
    where = f"host {position} of {count}" if count > 1 else "the host"
    if entry.startswith("["):  # an IPv6 address, [::1]:5432
        host, bracket, rest = entry[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ImproperlyConfigured(f"{name}: {where} is not written [IPv6 address]:port")
        port = rest[1:]
    else:
        host, _, port = entry.partition(":")
    if count > 1 and not host:
        raise ImproperlyConfigured(f"{name}: {where} is empty")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ImproperlyConfigured(f"{name}: the port of {where} is not a number from 1 to 65535")
    return unquote(host), port


def parse_database_url(name: str, url: str) -> dict[str, object]:
    """``postgres://user:pass@host:port/dbname?opt=v`` → a Django DATABASES entry.

    Several hosts may be given in libpq's failover form,
    ``postgres://user@db1:5432,db2:5432/dbname?target_session_attrs=read-write``: HOST and PORT
    become libpq's comma-separated lists (Django and psycopg pass them through), and
    ``target_session_attrs`` must then be ``read-write`` or ``primary``. A socket directory may
    be given as ``?host=/path`` (what pgserver hands out). Errors name the variable but never
    repeat the URL, which may carry a password.
    """
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": an unbalanced [ or ]
        raise ImproperlyConfigured(
            f"{name}: not a URL: {exc}; an IPv6 host needs [ and ]"
        ) from None
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(
            f"{name}: only postgres:// URLs are supported, not {parts.scheme!r}://"
        )
    dbname = unquote(parts.path.lstrip("/"))
    if not dbname:
        raise ImproperlyConfigured(f"{name}: the database name is missing")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    entries = hostlist.split(",")
    pairs = [_host_and_port(name, e, i, len(entries)) for i, e in enumerate(entries, 1)]
    query = dict(parse_qsl(parts.query))
    socket_dir = query.pop("host", None)
    attrs = query.get("target_session_attrs")
    if attrs is not None and attrs not in SESSION_ATTRS:
        raise ImproperlyConfigured(
            f"{name}: target_session_attrs must be one of {', '.join(sorted(SESSION_ATTRS))}"
        )
    if attrs is not None and attrs not in WRITABLE_SESSION_ATTRS:
        raise ImproperlyConfigured(
            f"{name}: target_session_attrs={attrs} may connect to a standby, where every write "
            "fails; use read-write or primary"
        )
    if len(pairs) > 1:
        if socket_dir:
            raise ImproperlyConfigured(f"{name}: ?host= cannot be combined with several hosts")
        if attrs is None:
            raise ImproperlyConfigured(
                f"{name} names {len(pairs)} hosts but no target_session_attrs: libpq would "
                "take the first that answers, a standby after a failover, where every write "
                "fails. Add ?target_session_attrs=read-write"
            )
        query.setdefault("connect_timeout", MULTI_HOST_CONNECT_TIMEOUT)
    ports = [port for _, port in pairs]
    if any(ports) and len(pairs) > 1:
        # libpq wants one port or one per host; a host written without one gets the default.
        ports = [port or "5432" for port in ports]
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": dbname,
        "USER": unquote(user),
        "PASSWORD": unquote(password),
        "HOST": socket_dir or ",".join(host for host, _ in pairs),
        "PORT": ",".join(ports) if any(ports) else "",
        "OPTIONS": query,
    }


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = env_str(name, default).strip().lower()
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


# DATABASE_POOLING: how DATABASE_URL reaches PostgreSQL. "none": directly or through a pooler
# that keeps a client on one server connection (PgBouncer's session pooling). "transaction":
# through a transaction pooler, where consecutive transactions may run on different server
# connections, so nothing may rely on the session: advisory locks held across transactions,
# session settings, pg_backend_pid(), prepared statements, server-side cursors.
POOLING_MODES = ("none", "transaction")
# The Django alias of the direct connection that carries the session state behind a transaction
# pooler (reservations.db.session_connection); without one, the session state is on "default".
SESSION_ALIAS = "locks"


def database_aliases(
    url: str, direct_url: str, pooling: str, *, conn_max_age: int
) -> dict[str, dict[str, object]]:
    """Django's DATABASES from ``DATABASE_URL``, ``DATABASE_DIRECT_URL`` and
    ``DATABASE_POOLING``: "default" always; with transaction pooling also ``SESSION_ALIAS``, the
    direct connection (required), and "default" without server-side cursors (a named cursor
    lives in its session)."""
    default = parse_database_url("DATABASE_URL", url)
    aliases: dict[str, dict[str, object]] = {"default": default}
    if pooling == "transaction":
        if not direct_url:
            raise ImproperlyConfigured(
                "DATABASE_POOLING=transaction needs DATABASE_DIRECT_URL: a direct (or "
                "session-pooled) connection to the same database, for the advisory locks and "
                "the beat's lease, which a transaction pooler cannot keep"
            )
        default["DISABLE_SERVER_SIDE_CURSORS"] = True
        aliases[SESSION_ALIAS] = parse_database_url("DATABASE_DIRECT_URL", direct_url)
        # Tests: the same test database as "default", not one of its own.
        aliases[SESSION_ALIAS]["TEST"] = {"MIRROR": "default"}
    for entry in aliases.values():
        # Workers and web requests reuse a connection for a while; health checks drop dead ones.
        # A session lock is never held across that reuse: Django closes an old connection only
        # between requests and Celery between tasks, and the sweep lets go of its locks first.
        entry["CONN_MAX_AGE"] = conn_max_age
        entry["CONN_HEALTH_CHECKS"] = True
    return aliases


def prepared_statements(pooling: str) -> bool:
    """Whether the release statement runs prepared: always, except behind a transaction pooler
    (``DATABASE_POOLING=transaction``), where the next statement may run on another server
    connection, one that never prepared it (PgBouncer before 1.21 does not follow it)."""
    return pooling != "transaction"


def refuse_retired(retired: Mapping[str, str]) -> None:
    """Start-up fails when a variable that is no longer read is still set, naming each and
    where its value lives now: a deployment that set one would otherwise run without it and
    never know. ``retired`` maps each name to that place; an empty value counts as unset."""
    found = [name for name in sorted(retired) if os.environ.get(name, "") != ""]
    if found:
        raise ImproperlyConfigured(
            "; ".join(
                f"{name} is no longer read from the environment: {retired[name]}" for name in found
            )
            + (". Unset it" if len(found) == 1 else ". Unset them")
        )
