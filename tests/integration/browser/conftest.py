"""Playwright driving Debian's ``chromium`` (found on PATH, never downloaded) against pytest-
django's live server.

Outside CI a missing browser skips these tests with the reason; with CI=true it fails them
(tests/support/missing_tools.py; scripts/test.sh installs chromium with apt in CI when it is
missing).
Screenshots go to ``$SCREENSHOT_DIR`` when set (docs/screenshots/ was made that way), else to
the test's tmp dir.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User

from tests.support.missing_tools import skip_for_missing
from tests.support.staff import logged_in

BROWSER_NAMES = ("chromium", "chromium-browser")
LAUNCH_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
USERNAME, PASSWORD = "ops", "ops-pass-1"


def find_chromium() -> str | None:
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        message = (
            "no chromium on PATH (Debian: apt-get install chromium); "
            "browser tests need the system browser and never download one"
        )
        skip_for_missing("chromium", message)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        skip_for_missing("playwright", f"playwright is not installed: {exc}")
    return path


@pytest.fixture(scope="module")
def browser(chromium_path: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread; Django's ORM refuses to run
    # where a loop exists unless told. The test body's ORM calls are ordinary sync code. Both
    # the loop and the permission last only for the module: later tests (and `check --deploy`,
    # which rejects the variable) never see them.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium_path, headless=True, args=LAUNCH_FLAGS
        )
        try:
            yield launched
        finally:
            launched.close()
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(15_000)
    tab = context.new_page()
    try:
        yield tab
    finally:
        context.close()


@pytest.fixture
def operator(transactional_db: None) -> User:
    return User.objects.create_superuser(USERNAME, "ops@example.com", PASSWORD)


@pytest.fixture
def signed_in(page: Any, operator: User, live_server: Any) -> Any:
    """The page with the operator's session cookie (the login form has its own test)."""
    client = logged_in(operator)
    page.context.add_cookies(
        [{"name": "sessionid", "value": client.cookies["sessionid"].value, "url": live_server.url}]
    )
    return page


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("SCREENSHOT_DIR") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target
