"""Production: no secret has a default, and development values are refused.

A missing or unsafe value fails at start-up with ``ImproperlyConfigured`` naming the variable,
so a server or worker started with a development .env (or with none) never runs. The checks
here are what ``manage.py check --deploy`` would warn about, made fatal. See docs/HARDENING.md.
"""

from django.core.exceptions import ImproperlyConfigured

from config.env import DEVELOPMENT_VALUES, env_bool, env_int, env_str

from .base import *  # noqa: F403
from .base import RESERVATIONS_API_TOKEN, SECRET_KEY

if env_bool("DEBUG", False):
    raise ImproperlyConfigured(
        "DEBUG=true is refused by config.settings.production: the debug page shows settings "
        "and connection URLs (with passwords) to anyone who triggers an error"
    )
DEBUG = False


def _refuse_weak(name: str, value: str, minimum_length: int) -> None:
    if value in DEVELOPMENT_VALUES.get(name, ()):
        raise ImproperlyConfigured(f"{name} is a development value; set a secret of your own")
    if len(value) < minimum_length or len(set(value)) < 5 or value.startswith("django-insecure"):
        raise ImproperlyConfigured(
            f"{name} is too weak: use at least {minimum_length} random characters "
            '(python -c "import secrets; print(secrets.token_urlsafe(48))")'
        )


_refuse_weak("SECRET_KEY", SECRET_KEY, 50)
_refuse_weak("RESERVATIONS_API_TOKEN", RESERVATIONS_API_TOKEN, 32)
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
if METRICS_TOKEN:
    _refuse_weak("METRICS_TOKEN", METRICS_TOKEN, 32)

FLOWER_BASIC_AUTH = env_str("FLOWER_BASIC_AUTH")

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
