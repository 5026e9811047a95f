"""TLS for Redis (``rediss://``): the options every client of the project uses, from one place.

Managed Redis speaks TLS. The workers' broker connection (kombu, through the project's screened
transport), the queue readers, the delivery counters and the autoscaler's readings (redis-py)
must all verify the same server the same way, so the options come either from the URL's own
query (``?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/redis-ca.pem``, the names kombu and
redis-py both read) or from the ``REDIS_TLS_*`` settings below, never a mix of the two: a URL
that carries some of them while settings carry others would be read differently by the two
libraries (kombu takes the URL's set whole, redis-py merges key by key).

``REDIS_TLS_VERIFY`` defaults to ``required``: kombu on its own falls back to *no* certificate
check for a ``rediss://`` URL without options (with a warning in the log). Production refuses
``none``/``optional`` and a switched-off host-name check (config.settings.production).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from django.core.exceptions import ImproperlyConfigured

from config.env import env_bool, env_str

# The query names kombu (kombu.utils.url.parse_url) and redis-py (redis.connection.parse_url)
# read from a rediss:// URL, and the setting for each.
SETTING_FOR_QUERY = {
    "ssl_cert_reqs": "REDIS_TLS_VERIFY",
    "ssl_ca_certs": "REDIS_TLS_CA_FILE",
    "ssl_certfile": "REDIS_TLS_CERT_FILE",
    "ssl_keyfile": "REDIS_TLS_KEY_FILE",
    "ssl_check_hostname": "REDIS_TLS_CHECK_HOSTNAME",
}
VERIFY_MODES = ("required", "optional", "none")
FILES = ("REDIS_TLS_CA_FILE", "REDIS_TLS_CERT_FILE", "REDIS_TLS_KEY_FILE")


def is_tls(url: str) -> bool:
    return url.startswith("rediss://")


def url_options(url: str) -> dict[str, str]:
    """The TLS options a URL's query carries (by their query names)."""
    return {k: v for k, v in parse_qsl(urlsplit(url).query) if k in SETTING_FOR_QUERY}


def options_from_environment() -> dict[str, Any]:
    """The ``REDIS_TLS_*`` settings as redis-py/kombu options; a bad value or a missing file
    fails here, naming the variable."""
    verify = env_str("REDIS_TLS_VERIFY", "required").strip().lower()
    if verify not in VERIFY_MODES:
        raise ImproperlyConfigured(
            f"REDIS_TLS_VERIFY={verify!r}: expected one of {', '.join(VERIFY_MODES)}"
        )
    options: dict[str, Any] = {
        "ssl_cert_reqs": verify,
        "ssl_check_hostname": env_bool("REDIS_TLS_CHECK_HOSTNAME", True),
    }
    for query, name in SETTING_FOR_QUERY.items():
        if name not in FILES:
            continue
        path = env_str(name, "").strip()
        if not path:
            continue
        if not os.path.isfile(path):
            raise ImproperlyConfigured(f"{name}={path!r}: no such file")
        options[query] = path
    key, cert = options.get("ssl_keyfile"), options.get("ssl_certfile")
    if bool(key) != bool(cert):
        raise ImproperlyConfigured(
            "REDIS_TLS_CERT_FILE and REDIS_TLS_KEY_FILE: a client certificate needs both"
        )
    return options


def explicit_settings() -> list[str]:
    """The ``REDIS_TLS_*`` variables set in the environment."""
    return [name for name in SETTING_FOR_QUERY.values() if env_str(name, "").strip()]


def for_url(variable: str, url: str, settings_options: dict[str, Any]) -> dict[str, Any]:
    """The options a client of ``url`` must be given besides the URL itself: none for a plain
    ``redis://`` URL or one whose query carries them; the settings' otherwise. A URL with TLS
    options while ``REDIS_TLS_*`` are set too is refused, naming both."""
    if not is_tls(url):
        return {}
    in_url = url_options(url)
    if in_url:
        mixed = explicit_settings()
        if mixed:
            raise ImproperlyConfigured(
                f"{variable} carries TLS options in its query ({', '.join(sorted(in_url))}) "
                f"while {', '.join(mixed)} {'is' if len(mixed) == 1 else 'are'} set too: "
                "give them in one place"
            )
        return {}
    return dict(settings_options)


def effective(url: str, settings_options: dict[str, Any]) -> dict[str, Any]:
    """What a client of ``url`` ends up verifying: the URL's options, else the settings'."""
    in_url = url_options(url)
    if not in_url:
        return dict(settings_options)
    merged: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    for key, value in in_url.items():
        merged[key] = value.lower() != "false" if key == "ssl_check_hostname" else value
    return merged
