"""The admin's login lockouts through a real gunicorn (config/admin_login.py): behind a proxy
that appends the client's address to X-Forwarded-For (TRUSTED_PROXY_COUNT=1), and reached
directly from many loopback addresses (TRUSTED_PROXY_COUNT=0).

- A stranger failing again and again from one address is locked out there; the administrator
  logging in from another address is not.
- Guessing one username from many addresses locks it for browsers that never logged in as that
  user; a browser that did (a known device) still gets in.
"""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import urlencode

import pytest
from django.contrib.auth.models import User

from config.admin_login import KNOWN_DEVICE_COOKIE
from tests.support.web import WebServer, gunicorn

PASSWORD = "correct-horse-battery-staple-9"
ADMIN = "admin"
FAILURE_LIMIT = 2  # AXES_FAILURE_LIMIT, lowered for the test
USERNAME_LIMIT = 4 * FAILURE_LIMIT  # LOGIN_USERNAME_FAILURE_LIMIT, derived from it


@dataclass
class Browser:
    """One browser (its own cookies) at one client address: behind the proxy the address is the
    one the proxy appends to X-Forwarded-For; without it, the loopback address it connects from."""

    web: WebServer
    address: str
    behind_proxy: bool
    forwarded_by_client: str = ""  # what the browser itself puts in X-Forwarded-For
    cookies: dict[str, str] = field(default_factory=dict)
    last_text: str = ""

    def _send(self, method: str, path: str, body: str | None = None) -> http.client.HTTPResponse:
        source = None if self.behind_proxy else (self.address, 0)
        conn = http.client.HTTPConnection("127.0.0.1", self.web.port, 30, source)
        headers = {"Host": "127.0.0.1"}
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        hops = [hop for hop in (self.forwarded_by_client,) if hop]
        if self.behind_proxy:
            hops.append(self.address)  # the proxy appends the address it was connected from
        if hops:
            headers["X-Forwarded-For"] = ", ".join(hops)
        if body is not None:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
            headers["Referer"] = f"http://127.0.0.1:{self.web.port}/admin/login/"
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        self.last_text = response.read().decode(errors="replace")
        for header in response.headers.get_all("Set-Cookie") or []:
            for name, morsel in SimpleCookie(header).items():
                self.cookies[name] = morsel.value
        conn.close()
        return response

    def log_in(self, password: str, username: str = ADMIN) -> int:
        """The admin's login form, as a browser fills it in: the status of the POST (302 in,
        200 the form again, 429 locked out)."""
        conn_page = self._page("/admin/login/?next=/admin/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', conn_page)
        assert token, conn_page[:500]
        form = {
            "csrfmiddlewaretoken": token[1],
            "username": username,
            "password": password,
            "next": "/admin/",
        }
        return self._send("POST", "/admin/login/?next=/admin/", urlencode(form)).status

    def _page(self, path: str) -> str:
        source = None if self.behind_proxy else (self.address, 0)
        conn = http.client.HTTPConnection("127.0.0.1", self.web.port, 30, source)
        headers = {"Host": "127.0.0.1"}
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        if self.behind_proxy:
            headers["X-Forwarded-For"] = self.address
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        text = response.read().decode()
        for header in response.headers.get_all("Set-Cookie") or []:
            for name, morsel in SimpleCookie(header).items():
                self.cookies[name] = morsel.value
        conn.close()
        return text

    def sees_the_admin(self) -> bool:
        source = None if self.behind_proxy else (self.address, 0)
        conn = http.client.HTTPConnection("127.0.0.1", self.web.port, 30, source)
        headers = {
            "Host": "127.0.0.1",
            "Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items()),
        }
        conn.request("GET", "/admin/", headers=headers)
        status = conn.getresponse().status
        conn.close()
        return status == 200


@pytest.fixture
def admin(transactional_db: None) -> User:
    return User.objects.create_superuser(ADMIN, "admin@example.com", PASSWORD)


@pytest.fixture
def behind_a_proxy(admin: User, tmp_path: Path) -> Iterator[WebServer]:
    env = {"TRUSTED_PROXY_COUNT": "1", "AXES_FAILURE_LIMIT": str(FAILURE_LIMIT)}
    with gunicorn(tmp_path, workers=1, threads=2, **env) as server:
        yield server


@pytest.fixture
def reached_directly(admin: User, tmp_path: Path) -> Iterator[WebServer]:
    env = {"TRUSTED_PROXY_COUNT": "0", "AXES_FAILURE_LIMIT": str(FAILURE_LIMIT)}
    with gunicorn(tmp_path, workers=1, threads=2, **env) as server:
        yield server


def test_a_stranger_behind_the_proxy_cannot_lock_the_administrator_out(behind_a_proxy):
    # given: a stranger at address A guessing the administrator's password, forging a different
    # X-Forwarded-For entry of their own each time
    stranger = Browser(behind_a_proxy, "203.0.113.10", behind_proxy=True)
    answers = []
    for attempt in range(FAILURE_LIMIT + 2):
        stranger.forwarded_by_client = f"198.51.100.{attempt + 1}"
        answers.append(stranger.log_in("wrong"))
    # then: locked out at A (the forged entries did not make new addresses)
    assert answers[: FAILURE_LIMIT - 1] == [200] * (FAILURE_LIMIT - 1)
    assert answers[FAILURE_LIMIT - 1 :] == [429] * 3
    assert stranger.log_in(PASSWORD) == 429
    # when: the administrator logs in from address B, in a browser never used before
    administrator = Browser(behind_a_proxy, "203.0.113.20", behind_proxy=True)
    # then: in, and the admin (the pause switch, the health page) answers
    assert administrator.log_in(PASSWORD) == 302
    assert administrator.sees_the_admin()


def _guess_from_many_addresses(
    web: WebServer, behind_proxy: bool, addresses: list[str]
) -> list[int]:
    return [Browser(web, address, behind_proxy).log_in("wrong") for address in addresses]


@pytest.mark.parametrize("behind_proxy", [True, False], ids=["behind-a-proxy", "direct"])
def test_guessing_from_many_addresses_is_limited_but_a_known_device_gets_in(
    transactional_db, request, behind_proxy
):
    web = request.getfixturevalue("behind_a_proxy" if behind_proxy else "reached_directly")
    prefix = "203.0.113." if behind_proxy else "127.0.0."
    # given: the administrator's own browser, which has logged in before
    own = Browser(web, f"{prefix}200", behind_proxy)
    assert own.log_in(PASSWORD) == 302
    assert KNOWN_DEVICE_COOKIE in own.cookies
    own.cookies = {KNOWN_DEVICE_COOKIE: own.cookies[KNOWN_DEVICE_COOKIE]}  # logged out
    # when: one wrong password each from many addresses, none of them near the per-address
    # limit: the last one reaches the username's limit (the answer to it is already 429)
    addresses = [f"{prefix}{i}" for i in range(2, 2 + USERNAME_LIMIT)]
    answers = _guess_from_many_addresses(web, behind_proxy, addresses)
    assert answers == [200] * (USERNAME_LIMIT - 1) + [429]
    # then: a browser that never logged in as the administrator is refused, at a new address,
    # even with the right password
    newcomer = Browser(web, f"{prefix}150", behind_proxy)
    assert newcomer.log_in(PASSWORD) == 429
    # and the administrator's own browser, from yet another address, gets in
    own.address = f"{prefix}201"
    assert own.log_in(PASSWORD) == 302
    assert own.sees_the_admin()
    # a forged cookie is no known device
    forger = Browser(web, f"{prefix}151", behind_proxy, cookies={KNOWN_DEVICE_COOKIE: "admin:x:y"})
    assert forger.log_in(PASSWORD) == 429
