"""Production settings refuse development values at start-up, naming the variable; processes
started without DJANGO_SETTINGS_MODULE get production, not local, settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STRONG = {
    "SECRET_KEY": "k3Jq9-vX2mPzR7tWc8YbN4hL6sD1fGa5eU0iOyTqZxCvBnMlKjHg",
    "RESERVATIONS_API_TOKEN": "tok-8Zq2Lm5Xv9Rb3Nc7Wd1Fh6Jk4Ps0Ty2",
    "FLOWER_BASIC_AUTH": "ops:9f8e7d6c5b4a",
    "DATABASE_URL": "postgres://app@db.internal:5432/reservations",
    "CELERY_BROKER_URL": "redis://:pw@redis.internal:6379/0",
    "DEBUG": "",
    "METRICS_TOKEN": "",
}


def run_python(code: str, **changes: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(STRONG)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def load_production(**changes: str | None) -> subprocess.CompletedProcess[str]:
    return run_python("import config.settings.production", **changes)


def test_production_starts_with_strong_values() -> None:
    out = load_production()
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"DEBUG": "true"}, "DEBUG=true is refused"),
        ({"SECRET_KEY": "local-dev-only-not-secret"}, "SECRET_KEY is a development value"),
        ({"SECRET_KEY": "test-only-not-secret"}, "SECRET_KEY is a development value"),
        ({"SECRET_KEY": "short-but-random-7Yq"}, "SECRET_KEY is too weak"),
        ({"SECRET_KEY": None}, "SECRET_KEY must be set"),
        (
            {"RESERVATIONS_API_TOKEN": "local-dev-token"},
            "RESERVATIONS_API_TOKEN is a development value",
        ),
        ({"RESERVATIONS_API_TOKEN": "abc"}, "RESERVATIONS_API_TOKEN is too weak"),
        ({"METRICS_TOKEN": "metrics"}, "METRICS_TOKEN is too weak"),
        ({"FLOWER_BASIC_AUTH": None}, "FLOWER_BASIC_AUTH must be set"),
    ],
)
def test_production_refuses_development_values_naming_the_variable(
    changes: dict[str, str | None], words: str
) -> None:
    out = load_production(**changes)
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]


def test_forwarded_proto_is_trusted_only_when_configured() -> None:
    code = (
        "import config.settings.production as s; print(getattr(s, 'SECURE_PROXY_SSL_HEADER', None))"
    )
    assert run_python(code).stdout.strip() == "None"
    trusted = run_python(code, SECURE_PROXY_SSL_HEADER="true").stdout.strip()
    assert trusted == "('HTTP_X_FORWARDED_PROTO', 'https')"


@pytest.mark.parametrize("module", ["config.wsgi", "config.celery_app"])
def test_a_server_or_worker_started_without_a_settings_module_gets_production(
    module: str,
) -> None:
    # given: no DJANGO_SETTINGS_MODULE and the development secrets a local .env would carry
    code = (
        f"import {module}; from django.conf import settings; "
        "print(settings.SETTINGS_MODULE, settings.DEBUG)"
    )
    out = run_python(code, SECRET_KEY="local-dev-only-not-secret", DEBUG="true")
    # then: it refuses to start instead of running with DEBUG and public secrets
    assert out.returncode != 0
    assert "ImproperlyConfigured" in out.stderr
    ok = run_python(code)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split()[-2:] == ["config.settings.production", "False"]


def test_deploy_check_reports_nothing_with_the_documented_variables() -> None:
    out = run_python(
        "import sys; from django.core.management import execute_from_command_line; "
        "execute_from_command_line(['manage.py', 'check', '--deploy', '--fail-level', 'WARNING'])",
        DJANGO_SETTINGS_MODULE="config.settings.production",
        SECURE_HSTS_INCLUDE_SUBDOMAINS="true",
        SECURE_HSTS_PRELOAD="true",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no issues" in out.stdout


def test_local_settings_start_on_a_fresh_clone_with_nothing_set() -> None:
    # given: none of the variables production refuses to default (what `make run` starts with)
    unset: dict[str, str | None] = {k: None for k in STRONG}
    out = run_python(
        "from django.conf import settings; import os;"
        "os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings.local';"
        "print(settings.DEBUG, settings.DATABASES['default']['NAME'], bool(settings.SECRET_KEY))",
        **unset,
    )
    # then: development defaults, a local database, debug on
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "reservations", "True"]
