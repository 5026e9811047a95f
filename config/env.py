"""Strict readers for settings that come from the environment.

Every helper raises ``ImproperlyConfigured`` naming the variable, so a bad value fails at
start-up instead of at 3 a.m. (healthchecks' ``envbool`` is the model).
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_MISSING = object()

# Values the development and test settings fill in; production refuses every one of them.
DEVELOPMENT_VALUES: dict[str, frozenset[str]] = {
    "SECRET_KEY": frozenset({"local-dev-only-not-secret", "test-only-not-secret"}),
    "RESERVATIONS_API_TOKEN": frozenset({"local-dev-token", "test-token"}),
}
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


def parse_database_url(name: str, url: str) -> dict[str, object]:
    """``postgres://user:pass@host:port/dbname?opt=v`` → a Django DATABASES entry.

    A socket directory may be given as ``?host=/path`` (what pgserver hands out).
    """
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(f"{name}={url!r}: only postgres:// URLs are supported")
    dbname = unquote(parts.path.lstrip("/"))
    if not dbname:
        raise ImproperlyConfigured(f"{name}={url!r}: the database name is missing")
    try:
        port = parts.port
    except ValueError:
        raise ImproperlyConfigured(f"{name}={url!r}: the port is not a number") from None
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
