"""Strict readers for settings that come from the environment.

Every helper raises ``ImproperlyConfigured`` naming the variable, so a bad value fails at
start-up instead of at 3 a.m. (healthchecks' ``envbool`` is the model).
"""

from __future__ import annotations

import os
from collections.abc import Callable
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


def parse_database_url(name: str, url: str) -> dict[str, object]:
    """``postgres://user:pass@host:port/dbname?opt=v`` → a Django DATABASES entry.

    A socket directory may be given as ``?host=/path`` (what pgserver hands out). Errors name
    the variable but never repeat the URL, which may carry a password.
    """
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(
            f"{name}: only postgres:// URLs are supported, not {parts.scheme!r}://"
        )
    dbname = unquote(parts.path.lstrip("/"))
    if not dbname:
        raise ImproperlyConfigured(f"{name}: the database name is missing")
    try:
        port = parts.port
    except ValueError:
        raise ImproperlyConfigured(f"{name}: the port is not a number") from None
    query = dict(parse_qsl(parts.query))
    host = query.pop("host", None) or unquote(parts.hostname or "")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": dbname,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(port or ""),
        "OPTIONS": query,
    }
