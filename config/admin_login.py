"""Who is trying to log in to the admin, for django-axes' lockouts.

Two rules (settings: ``AXES_LOCKOUT_PARAMETERS``, ``AXES_CLIENT_IP_CALLABLE``):

- **Per username and address**: ``AXES_FAILURE_LIMIT`` failures for one username from one client
  address lock that pair. The address is the client's own, read through ``TRUSTED_PROXY_COUNT``
  proxies (``client_ip``): behind a proxy every visitor would otherwise share the proxy's address,
  and five wrong passwords from anywhere would lock the real administrator out.
- **Per username, unknown devices only**: once a username has ``LOGIN_USERNAME_FAILURE_LIMIT``
  failures within the cool-off (each address counted up to ``AXES_FAILURE_LIMIT``, so it takes
  several addresses), it is locked for every browser without a known-device cookie for it, so
  guessing from many addresses is limited too. A browser that
  logged in as that user before carries a signed cookie (``KnownDeviceMiddleware``) and is held
  only to the first rule: a stranger cannot lock the owner out (OWASP, "slow down online guessing
  with device cookies").
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from axes.helpers import get_client_username
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth.signals import user_logged_in
from django.core import signing
from django.db.models import Sum
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

PAIR = ["username", "ip_address"]
KNOWN_DEVICE_COOKIE = "admin_known_device"
KNOWN_DEVICE_SALT = "config.admin_login.known-device"
KNOWN_DEVICE_DAYS = 180


def client_ip(request: HttpRequest) -> str | None:
    """The client's address: ``REMOTE_ADDR`` without trusted proxies; behind ``n`` of them, the
    ``n``-th address of ``X-Forwarded-For`` from the right (each proxy appends the address it
    was connected from, so those entries are the proxies' own; the ones further left are
    whatever the client sent). Fewer entries than proxies: the leftmost, which a trusted proxy
    wrote. An entry that is not an IP address: ``REMOTE_ADDR``."""
    remote: str | None = request.META.get("REMOTE_ADDR")
    count = int(getattr(settings, "TRUSTED_PROXY_COUNT", 0))
    if count <= 0:
        return remote
    header = request.META.get("HTTP_X_FORWARDED_FOR", "")
    hops = [hop.strip() for hop in header.split(",") if hop.strip()]
    if not hops:
        return remote
    candidate = hops[-min(count, len(hops))]
    try:
        return str(ipaddress.ip_address(candidate))
    except ValueError:
        return remote


def _signer() -> signing.TimestampSigner:
    return signing.TimestampSigner(salt=KNOWN_DEVICE_SALT)


def known_device_value(username: str) -> str:
    return _signer().sign(username)


def is_known_device(request: HttpRequest, username: str) -> bool:
    """Whether this browser logged in as ``username`` within ``KNOWN_DEVICE_DAYS``."""
    value = request.COOKIES.get(KNOWN_DEVICE_COOKIE)
    if not value:
        return False
    try:
        signed_for = _signer().unsign(value, max_age=KNOWN_DEVICE_DAYS * 86400)
    except signing.BadSignature:
        return False
    return bool(signed_for == username)


def username_failures(username: str) -> int:
    """Failed logins for ``username`` within the cool-off, from any addresses, each address
    counted up to ``AXES_FAILURE_LIMIT``: one address already locked out adds nothing more by
    going on, so a single stranger cannot reach the username's limit alone."""
    since = timezone.now() - settings.AXES_COOLOFF_TIME
    per_address = settings.AXES_FAILURE_LIMIT
    counted = 0
    rows = (
        AccessAttempt.objects.filter(username=username, attempt_time__gte=since)
        .values("ip_address")
        .annotate(failures=Sum("failures_since_start"))
        .values_list("failures", flat=True)
    )
    for failures in rows.iterator():
        counted += min(int(failures or 0), per_address)
        if counted >= settings.LOGIN_USERNAME_FAILURE_LIMIT:
            break
    return counted


def lockout_parameters(request_or_attempt: Any, credentials: dict[str, Any] | None = None) -> list:
    """django-axes' lockout keys for this login: always the username-and-address pair; for an
    unknown device, the username alone too once it reached ``LOGIN_USERNAME_FAILURE_LIMIT``
    failures. django-axes locks when any key's count reaches ``AXES_FAILURE_LIMIT``; the
    username's count is then at least ``LOGIN_USERNAME_FAILURE_LIMIT``, which is no lower."""
    if not hasattr(request_or_attempt, "COOKIES"):  # an AccessAttempt (resets, the admin)
        return [PAIR]
    username = get_client_username(request_or_attempt, credentials)
    if not username or is_known_device(request_or_attempt, username):
        return [PAIR]
    if username_failures(username) >= settings.LOGIN_USERNAME_FAILURE_LIMIT:
        return [PAIR, "username"]
    return [PAIR]


@receiver(user_logged_in)
def _remember_device(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    if request is not None:
        request.known_device_for = user.get_username()  # type: ignore[attr-defined]


class KnownDeviceMiddleware:
    """Sets the known-device cookie on the response to a successful login: signed, for that
    username, HTTP-only, secure when the session cookie is."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        username = getattr(request, "known_device_for", None)
        if username:
            response.set_cookie(
                KNOWN_DEVICE_COOKIE,
                known_device_value(username),
                max_age=KNOWN_DEVICE_DAYS * 86400,
                httponly=True,
                secure=settings.SESSION_COOKIE_SECURE,
                samesite="Lax",
            )
        return response
