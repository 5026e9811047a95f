"""``python -c`` in a fresh interpreter: how a test sees what a process starting from nothing
sees (settings read at start-up, the transport the settings choose, a refusal at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping

from tests.support import ROOT

# The settings module of a child process given Django settings of its own
# (tests/support/child_settings.py) and the variable that carries them, as JSON.
CHILD_SETTINGS_MODULE = "tests.support.child_settings"
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


def run_with(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` with the test settings, database and broker (``fleet.service_env``), and
    ``env`` on top: what a worker or the web started with those variables would see."""
    from tests.support.fleet import service_env

    return run_python(code, service_env(**env))


# Strong values for every variable production refuses to default: what a deployer sets.
DEPLOYED = {
    "SECRET_KEY": "k3Jq9-vX2mPzR7tWc8YbN4hL6sD1fGa5eU0iOyTqZxCvBnMlKjHg",
    "RESERVATIONS_API_TOKEN": "",
    "FLOWER_BASIC_AUTH": "ops:9f8e7d6c5b4a",
    "DATABASE_URL": "postgres://app@db.internal:5432/reservations",
    "CELERY_BROKER_URL": "redis://:pw@redis.internal:6379/0",
    "DEBUG": "",
    "METRICS_TOKEN": "",
    "TRUSTED_PROXY_COUNT": "0",
}


def run_as_deployed(code: str, **changes: str | None) -> subprocess.CompletedProcess[str]:
    """``code`` started as a deployment starts a process: no DJANGO_SETTINGS_MODULE, the
    ``DEPLOYED`` values, then ``changes`` (``None`` unsets a variable)."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(DEPLOYED)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return run_python(code, env)
