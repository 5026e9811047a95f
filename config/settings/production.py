"""Production: no secret has a default, and development values are refused.

A missing or unsafe value fails at start-up with ``ImproperlyConfigured`` naming the variable,
so a server or worker started with a development .env (or with none) never runs. The checks
here are what ``manage.py check --deploy`` would warn about, made fatal. See docs/HARDENING.md.
"""

import ipaddress
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

from config import redis_tls
from config.env import (
    DEVELOPMENT_VALUES,
    EXAMPLE_MARKER,
    EXAMPLE_PASSWORDS,
    env_bool,
    env_int,
    env_str,
)
from reservations import redis_sentinel

from .base import *  # noqa: F403
from .base import (
    CELERY_BROKER_URL,
    REDIS_TLS_OPTIONS,
    RESERVATIONS_API_TOKEN,
    SECRET_KEY,
    _cleanup,
)

if env_bool("DEBUG", False):
    raise ImproperlyConfigured(
        "DEBUG=true is refused by config.settings.production: the debug page shows settings "
        "and connection URLs (with passwords) to anyone who triggers an error"
    )
DEBUG = False


def _refuse_weak(name: str, value: str, minimum_length: int) -> None:
    if value in DEVELOPMENT_VALUES.get(name, ()):
        raise ImproperlyConfigured(f"{name} is a development value; set a secret of your own")
    if EXAMPLE_MARKER in value.lower():
        raise ImproperlyConfigured(
            f"{name} is still .env.example's placeholder; set a secret of your own "
            "(python3 scripts/make_env.py writes them)"
        )
    if len(value) < minimum_length or len(set(value)) < 5 or value.startswith("django-insecure"):
        raise ImproperlyConfigured(
            f"{name} is too weak: use at least {minimum_length} random characters "
            '(python -c "import secrets; print(secrets.token_urlsafe(48))")'
        )


_refuse_weak("SECRET_KEY", SECRET_KEY, 50)
# The shared token is one secret for every caller, with every scope and no rate limit: fine on
# a laptop, never in production, where each caller is an API client with its own tokens.
if RESERVATIONS_API_TOKEN:
    raise ImproperlyConfigured(
        "RESERVATIONS_API_TOKEN is set: the shared token is for local development only; in "
        "production unset it and give each caller an API client with its own token "
        "(admin: API clients, docs/API.md)"
    )
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
if METRICS_TOKEN:
    _refuse_weak("METRICS_TOKEN", METRICS_TOKEN, 32)

# --- credentials: Flower's login, and the passwords inside URLs ---------------------------------
# Messages name the variable (and which entry), never the value: a refused password must not
# end up in a log.
FLOWER_MIN_PASSWORD_LENGTH = 12
_generate_hint = 'python -c "import secrets; print(secrets.token_urlsafe(24))"'


def _is_example_password(password: str) -> bool:
    return password in EXAMPLE_PASSWORDS or EXAMPLE_MARKER in password.lower()


def _refuse_weak_flower_auth(name: str, value: str) -> None:
    """Flower splits the value on commas and compares each ``user:password`` whole with what a
    browser sends; every entry is a login, so every entry is checked."""
    if value in DEVELOPMENT_VALUES.get(name, ()):
        raise ImproperlyConfigured(
            f"{name} is a development or example value (the README's local login or "
            ".env.example's placeholder); set a user and password of your own"
        )
    entries = value.split(",")
    for number, entry in enumerate(entries, 1):
        where = f"{name} (entry {number} of {len(entries)})" if len(entries) > 1 else name
        user, colon, password = entry.partition(":")
        if not colon or not user.strip():
            raise ImproperlyConfigured(
                f"{where} is not user:password (Flower takes user:password, or several "
                "separated by commas)"
            )
        if not password:
            raise ImproperlyConfigured(f"{where} has an empty password")
        if _is_example_password(password):
            raise ImproperlyConfigured(
                f"{where} has a development or example password (from the README, the docs or "
                ".env.example); set one of your own"
            )
        if len(password) < FLOWER_MIN_PASSWORD_LENGTH or len(set(password)) < 5:
            raise ImproperlyConfigured(
                f"{where} has a weak password: use at least {FLOWER_MIN_PASSWORD_LENGTH} random "
                f"characters ({_generate_hint})"
            )


def _entries(url: str) -> list[str]:
    """The entries of a URL separated by ``;``: a Sentinel URL's sentinels, or a failover
    list's brokers (``amqp://…;amqp://…``); any other URL is one."""
    return url.split(";")


def _url_passwords(url: str) -> list[str]:
    """The non-empty passwords a URL carries: in its user part, or as ``?password=``. Of a URL
    with several entries, the first's (for a Sentinel URL the only one kombu reads)."""
    parts = urlsplit(_entries(url)[0])
    found = [unquote(parts.password)] if parts.password else []
    found += [v for k, v in parse_qsl(parts.query) if k.lower() == "password" and v]
    return found


def _all_passwords(url: str) -> list[str]:
    """Every password written anywhere in the URL (each entry of a Sentinel URL or of a
    failover list)."""
    return [p for entry in _entries(url) for p in _url_passwords(entry)]


def _is_local_host(url: str) -> bool:
    return all(_is_local_entry(entry) for entry in _entries(url))


def _is_local_entry(url: str) -> bool:
    host = urlsplit(url).hostname or ""  # no host: the client library's default, localhost
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _refuse_example_url_password(name: str, url: str) -> None:
    if any(_is_example_password(p) for p in _all_passwords(url)):
        raise ImproperlyConfigured(
            f"{name} carries a development or example password (from .env.example, "
            "docker-compose's quick start, the README or the docs); set a password of your own"
        )


def _refuse_unauthenticated_remote(name: str, url: str) -> None:
    # A Sentinel URL's first entry carries the password for every sentinel (kombu reads only
    # that one); each broker of a failover list is a connection of its own, with its own.
    if redis_sentinel.is_sentinel(url):
        _refuse_unauthenticated_entry(name, url, _url_passwords(url), _is_local_host(url))
        return
    for entry in _entries(url):
        _refuse_unauthenticated_entry(name, entry, _url_passwords(entry), _is_local_entry(entry))


def _refuse_unauthenticated_entry(name: str, url: str, passwords: list[str], local: bool) -> None:
    if not passwords and not local:
        raise ImproperlyConfigured(
            f"{name} has no password and its host ({urlsplit(url).hostname}) is not local: "
            "anyone who reaches that server could publish messages the workers run. Put the "
            "server's password in the URL (redis://:PASSWORD@host:6379/0, "
            "amqp://user:PASSWORD@host:5672/vhost)"
        )


FLOWER_BASIC_AUTH = env_str("FLOWER_BASIC_AUTH")
_refuse_weak_flower_auth("FLOWER_BASIC_AUTH", FLOWER_BASIC_AUTH)

# Every URL setting: the two read from the environment (neither has a default outside local
# development) and any *_URL setting with a scheme (CLEANUP_COUNTER_REDIS_URL, ...).
_urls = {
    "DATABASE_URL": env_str("DATABASE_URL"),
    "CELERY_BROKER_URL": env_str("CELERY_BROKER_URL"),
    **{
        _name: _value
        for _name, _value in sorted(globals().items())
        if _name.endswith("_URL") and isinstance(_value, str) and "://" in _value
    },
}
for _name, _url in _urls.items():
    _refuse_example_url_password(_name, _url)
for _name in ("CELERY_BROKER_URL", "CLEANUP_COUNTER_REDIS_URL"):
    if _urls.get(_name):
        _refuse_unauthenticated_remote(_name, _urls[_name])

# The admin's lockouts key on the client's address, read through this many proxies: a wrong
# value either lumps every visitor together (a stranger locks the administrator out) or lets a
# client choose its address, so production takes no default (base.py checks the range).
env_int("TRUSTED_PROXY_COUNT")

# Only behind a proxy that sets (and strips from clients) X-Forwarded-Proto may the app trust
# it; otherwise any client could claim HTTPS. Off by default.
if env_bool("SECURE_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
# Probes and scrapers speak plain HTTP inside the deployment's network.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", True)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", True)


# --- TLS to Redis: certificate and host-name checks stay on ----------------------------------
def _refuse_unchecked_tls(variable: str, url: str) -> None:
    if not redis_tls.is_tls(url):
        return
    in_url = bool(redis_tls.url_options(url))
    options = redis_tls.effective(url, REDIS_TLS_OPTIONS)
    verify = str(options.get("ssl_cert_reqs", "required")).lower().removeprefix("cert_")
    if verify != "required":
        where = f"{variable}'s ssl_cert_reqs" if in_url else "REDIS_TLS_VERIFY"
        raise ImproperlyConfigured(
            f"{where}={verify}: production refuses a TLS connection to Redis that does not "
            "verify the server's certificate (anyone on the path could read and write the queue)"
        )
    if options.get("ssl_check_hostname") is False:
        where = f"{variable}'s ssl_check_hostname" if in_url else "REDIS_TLS_CHECK_HOSTNAME"
        raise ImproperlyConfigured(
            f"{where}=false: production refuses a TLS connection to Redis that accepts a "
            "certificate issued for another host"
        )


_refuse_unchecked_tls("CELERY_BROKER_URL", CELERY_BROKER_URL)
_refuse_unchecked_tls("CLEANUP_COUNTER_REDIS_URL", _cleanup.counter_redis_url)
