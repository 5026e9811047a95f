"""``python -c`` in a fresh interpreter: how a test sees what a process starting from nothing
sees (settings read at start-up, the transport the settings choose, a refusal at import)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The settings module of a child process given Django settings of its own (tests/child_settings.py)
# and the variable that carries them, as JSON.
CHILD_SETTINGS_MODULE = "tests.child_settings"
CHILD_SETTINGS_VARIABLE = "RESERVATIONS_TEST_SETTINGS"


def settings_env(settings: Mapping[str, object]) -> dict[str, str]:
    """The variables that give a child process these Django settings on top of the test
    settings: the cleanup's tuning settings (cleanup.conf.tuning: the release mode, the worker
    pools, ...), which are not environment variables, and any other Django setting. Empty for
    no settings: the child runs ``config.settings.test`` as it is."""
    if not settings:
        return {}
    return {
        "DJANGO_SETTINGS_MODULE": CHILD_SETTINGS_MODULE,
        CHILD_SETTINGS_VARIABLE: json.dumps(dict(settings)),
    }


def run_python(
    code: str, env: Mapping[str, str], *, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """``code`` run from the checkout's root with exactly ``env``; its output as text. A child
    that hangs fails the test after a minute instead of holding the run."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        check=check,
        timeout=60,
    )
