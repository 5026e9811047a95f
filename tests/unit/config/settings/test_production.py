"""Production settings refuse development values at start-up, naming the variable; processes
started without DJANGO_SETTINGS_MODULE get production, not local, settings."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.child_python import run_as_deployed
from tests.support.sentinel import MASTER


def load_production(**changes: str | None) -> subprocess.CompletedProcess[str]:
    return run_as_deployed("import config.settings.production", **changes)


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
            {"SECRET_KEY": "change-me-to-a-long-random-string-of-at-least-fifty-chars"},
            "SECRET_KEY is still .env.example's placeholder",
        ),
        ({"RESERVATIONS_API_TOKEN": "local-dev-token"}, "RESERVATIONS_API_TOKEN is set"),
        (
            {"RESERVATIONS_API_TOKEN": "tok-8Zq2Lm5Xv9Rb3Nc7Wd1Fh6Jk4Ps0Ty2"},
            "RESERVATIONS_API_TOKEN is set: the shared token is for local development only",
        ),
        ({"METRICS_TOKEN": "metrics"}, "METRICS_TOKEN is too weak"),
        (
            {"RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS": "10"},
            "RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS=10 must be >= 60",
        ),
        ({"AXES_FAILURE_LIMIT": "many"}, "AXES_FAILURE_LIMIT='many' is not an integer"),
        ({"ADMIN_PASSWORD_MIN_LENGTH": "4"}, "ADMIN_PASSWORD_MIN_LENGTH=4 must be >= 8"),
        ({"FLOWER_BASIC_AUTH": None}, "FLOWER_BASIC_AUTH must be set"),
        ({"TRUSTED_PROXY_COUNT": None}, "TRUSTED_PROXY_COUNT must be set"),
        ({"TRUSTED_PROXY_COUNT": "one"}, "TRUSTED_PROXY_COUNT='one' is not an integer"),
        ({"TRUSTED_PROXY_COUNT": "-1"}, "TRUSTED_PROXY_COUNT=-1 must be >= 0"),
        ({"TRUSTED_PROXY_COUNT": "9"}, "TRUSTED_PROXY_COUNT=9 must be <= 5"),
    ],
)
def test_production_refuses_development_values_naming_the_variable(
    changes: dict[str, str | None], words: str
) -> None:
    out = load_production(**changes)
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]


def refusal(out: subprocess.CompletedProcess[str]) -> str:
    """The ImproperlyConfigured message (the traceback's last line), not the traceback: its
    source lines and paths are not what an operator is shown."""
    assert out.returncode != 0, "the settings were accepted"
    lines = [line for line in out.stderr.splitlines() if "ImproperlyConfigured: " in line]
    assert lines, out.stderr[-800:]
    return lines[-1].split("ImproperlyConfigured: ", 1)[1]


# Each refused credential: (variable, value, the words of the message, the secret that must
# not appear in it). The secrets are what the README and docs, .env.example and docker-compose.yml's
# quick start publish, or weak or malformed values. Grouped by refusal; within a group a row is
# (value, [words,] secret, id).
FLOWER_LOGINS = [
    ("admin:admin", "is a development or example value", "admin", "flower-readme-local-login"),
    ("admin:change-me-flower", "is a development or example value", "change-me-flower",
     "flower-env-example"),
    ("ops:change-me-later-please", "development or example password", "change-me-later-please",
     "flower-placeholder-left-in"),
    ("ops:", "has an empty password", None, "flower-empty-password"),
    ("ops:Sh0rt-pw-X", "has a weak password", "Sh0rt-pw-X", "flower-short-password"),
    ("ops:zzzzzzzzzzzzzzzz", "has a weak password", "zzzzzzzzzzzzzzzz",
     "flower-repetitive-password"),
    ("Qm7vX2pL9rT4wY8s", "is not user:password", "Qm7vX2pL9rT4wY8s", "flower-no-colon"),
    (":Qm7vX2pL9rT4wY8s", "is not user:password", "Qm7vX2pL9rT4wY8s", "flower-no-user"),
    ("ops:9f8e7d6c5b4a-Zq,viewer:admin", "(entry 2 of 2) has a development or example password",
     "viewer:admin", "flower-second-pair-example"),
    ("ops:9f8e7d6c5b4a-Zq,viewer:Wk4-short", "(entry 2 of 2) has a weak", "Wk4-short",
     "flower-second-pair-weak"),
    ("ops:9f8e7d6c5b4a-Zq,", "(entry 2 of 2) is not user:password", "9f8e7d6c5b4a-Zq",
     "flower-trailing-comma"),
]  # fmt: skip
# URLs carrying a published example password: (variable, URL, the password, id).
EXAMPLE_PASSWORD_URLS = [
    ("DATABASE_URL", "postgres://reservations:change-me-postgres@postgres:5432/reservations",
     "change-me-postgres", "database-env-example"),
    ("DATABASE_URL", "postgres://app@db.internal:5432/reservations?password=change-me-postgres",
     "change-me-postgres", "database-example-password-in-query"),
    ("CELERY_BROKER_URL", "redis://:change-me-redis@redis:6379/0", "change-me-redis",
     "broker-env-example"),
    ("CELERY_BROKER_URL", "redis://:change%2Dme-redis@redis:6379/0", "change%2Dme-redis",
     "broker-env-example-percent-encoded"),
    ("CELERY_BROKER_URL", "amqp://guest:guest@rabbit.internal:5672//", "guest",
     "broker-rabbitmq-guest"),
    ("CELERY_BROKER_URL", "amqp://app:Rb7-Qx2-Lm9@n1.internal/r;amqp://app:change-me-x@n2.internal/r",
     "change-me-x", "broker-cluster-second-node-example"),
    ("CLEANUP_COUNTER_REDIS_URL", "redis://:change-me-redis@counters.internal:6379/1",
     "change-me-redis", "counter-redis-env-example"),
]  # fmt: skip
# URLs of a remote server without a password: (variable, URL, its host, id).
UNAUTHENTICATED_REMOTE_URLS = [
    ("CELERY_BROKER_URL", "redis://redis.internal:6379/0", "redis.internal",
     "broker-redis-unauthenticated-remote"),
    ("CELERY_BROKER_URL", "amqp://rabbit.internal:5672//", "rabbit.internal",
     "broker-amqp-no-credentials-remote"),
    ("CELERY_BROKER_URL", "redis://:@10.0.0.7:6379/0", "10.0.0.7", "broker-empty-password-remote"),
    ("CELERY_BROKER_URL", "amqp://app:Rb7-Qx2-Lm9@n1.internal/r;amqp://n2.internal/r",
     "n2.internal", "broker-cluster-second-node-no-credentials"),
    ("CLEANUP_COUNTER_REDIS_URL", "redis://counters.internal:6379/1", "counters.internal",
     "counter-redis-unauthenticated-remote"),
]  # fmt: skip
CREDENTIAL_REFUSALS = [
    *(
        pytest.param("FLOWER_BASIC_AUTH", value, words, secret, id=case)
        for value, words, secret, case in FLOWER_LOGINS
    ),
    *(
        pytest.param(name, url, "carries a development or example password", secret, id=case)
        for name, url, secret, case in EXAMPLE_PASSWORD_URLS
    ),
    *(
        pytest.param(
            name, url, f"has no password and its host ({host}) is not local", None, id=case
        )
        for name, url, host, case in UNAUTHENTICATED_REMOTE_URLS
    ),
    pytest.param("CELERY_BROKER_URL", None, "must be set", None, id="broker-not-set"),
]


@pytest.mark.parametrize(("name", "value", "words", "secret"), CREDENTIAL_REFUSALS)
def test_production_refuses_example_weak_and_unauthenticated_credentials(
    name: str, value: str | None, words: str, secret: str | None
) -> None:
    message = refusal(load_production(**{name: value}))
    assert message.startswith(name), message
    assert words in message, message
    if secret is not None:
        assert secret not in message, message
        assert value is None or value not in message, message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FLOWER_BASIC_AUTH", "ops:9f8e7d6c5b4a-Zq,viewer:Lr5-Pw8-Kt3-Nv6"),
        ("FLOWER_BASIC_AUTH", "ops:pass:with:colons-7Yq"),
        ("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"),
        ("CELERY_BROKER_URL", "redis://localhost:6379/0"),
        ("CELERY_BROKER_URL", "redis://[::1]:6379/0"),
        ("CELERY_BROKER_URL", "amqp://app:Rb7-Qx2-Lm9@rabbit.internal:5672/reservations"),
        (
            "CELERY_BROKER_URL",
            "amqp://app:Rb7-Qx2-Lm9@n1.internal:5672/r;amqp://app:Rb7-Qx2-Lm9@n2.internal:5672/r",
        ),
        ("DATABASE_URL", "postgres://app@db.internal:5432/reservations"),
    ],
)
def test_production_accepts_strong_credentials_and_a_local_unauthenticated_broker(
    name: str, value: str
) -> None:
    out = load_production(**{name: value})
    assert out.returncode == 0, out.stderr[-800:]


def test_forwarded_proto_is_trusted_only_when_configured() -> None:
    code = (
        "import config.settings.production as s; print(getattr(s, 'SECURE_PROXY_SSL_HEADER', None))"
    )
    assert run_as_deployed(code).stdout.strip() == "None"
    trusted = run_as_deployed(code, SECURE_PROXY_SSL_HEADER="true").stdout.strip()
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
    out = run_as_deployed(code, SECRET_KEY="local-dev-only-not-secret", DEBUG="true")
    # then: it refuses to start instead of running with DEBUG and public secrets
    assert out.returncode != 0
    assert "ImproperlyConfigured" in out.stderr
    ok = run_as_deployed(code)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split()[-2:] == ["config.settings.production", "False"]


def test_deploy_check_reports_nothing_with_the_documented_variables() -> None:
    out = run_as_deployed(
        "import sys; from django.core.management import execute_from_command_line; "
        "execute_from_command_line(['manage.py', 'check', '--deploy', '--fail-level', 'WARNING'])",
        DJANGO_SETTINGS_MODULE="config.settings.production",
        SECURE_HSTS_INCLUDE_SUBDOMAINS="true",
        SECURE_HSTS_PRELOAD="true",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no issues" in out.stdout


# --- TLS to Redis ------------------------------------------------------------------------------

TLS_BROKER = "rediss://:pw@redis.internal:6380/0"


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"REDIS_TLS_VERIFY": "none"}, "REDIS_TLS_VERIFY=none: production refuses"),
        ({"REDIS_TLS_VERIFY": "optional"}, "REDIS_TLS_VERIFY=optional: production refuses"),
        ({"REDIS_TLS_CHECK_HOSTNAME": "false"}, "REDIS_TLS_CHECK_HOSTNAME=false: production"),
        (
            {"CELERY_BROKER_URL": TLS_BROKER + "?ssl_cert_reqs=none"},
            "CELERY_BROKER_URL's ssl_cert_reqs=none: production refuses",
        ),
        (
            {"CELERY_BROKER_URL": TLS_BROKER + "?ssl_cert_reqs=CERT_NONE"},
            "CELERY_BROKER_URL's ssl_cert_reqs=none: production refuses",
        ),
        ({"REDIS_TLS_VERIFY": "sometimes"}, "REDIS_TLS_VERIFY='sometimes': expected one of"),
        ({"REDIS_TLS_CA_FILE": "/nonexistent/ca.pem"}, "REDIS_TLS_CA_FILE='/nonexistent/ca.pem'"),
        (
            {
                "CELERY_BROKER_URL": TLS_BROKER + "?ssl_cert_reqs=required",
                "REDIS_TLS_CHECK_HOSTNAME": "true",
            },
            "CELERY_BROKER_URL carries TLS options in its query (ssl_cert_reqs) while "
            "REDIS_TLS_CHECK_HOSTNAME is set too",
        ),
    ],
)
def test_production_refuses_tls_to_redis_without_checks_naming_the_variable(
    changes: dict[str, str | None], words: str
) -> None:
    out = load_production(**{"CELERY_BROKER_URL": TLS_BROKER, **changes})
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]


def test_a_tls_broker_gets_the_screened_transport_and_checks_on_by_default() -> None:
    code = (
        "from django.conf import settings; import django; django.setup(); "
        "print(settings.CELERY_BROKER_TRANSPORT, settings.CELERY_BROKER_USE_SSL)"
    )
    out = run_as_deployed(
        code, CELERY_BROKER_URL=TLS_BROKER, DJANGO_SETTINGS_MODULE="config.settings.production"
    )
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.split(" ", 1)[0] == "cleanup.worker.redis_transport:Transport"
    assert (
        "'ssl_cert_reqs': 'required'" in out.stdout and "'ssl_check_hostname': True" in out.stdout
    )


@pytest.mark.parametrize(
    "url", ["sentinel://redis.internal:26379", "sqs://", "redis+socket:///tmp/r.sock"]
)
def test_a_broker_scheme_the_project_cannot_screen_is_refused_naming_the_variable(url: str) -> None:
    out = load_production(CELERY_BROKER_URL=url)
    assert out.returncode != 0
    assert "ImproperlyConfigured: CELERY_BROKER_URL" in out.stderr, out.stderr[-800:]


def test_production_takes_a_multi_host_database_url_only_with_the_writable_pick() -> None:
    failover = "postgres://app:pw-9f8e7d6c@db1.internal:5432,db2.internal:5432/reservations"
    started = load_production(DATABASE_URL=f"{failover}?target_session_attrs=read-write")
    assert started.returncode == 0, started.stderr
    refused = load_production(DATABASE_URL=failover)
    assert refused.returncode != 0
    assert "DATABASE_URL names 2 hosts but no target_session_attrs" in refused.stderr
    assert "pw-9f8e7d6c" not in refused.stderr
    example = load_production(
        DATABASE_URL="postgres://app:change-me-postgres@db1,db2/reservations"
        "?target_session_attrs=primary"
    )
    assert example.returncode != 0
    assert "DATABASE_URL" in example.stderr


# --- Redis Sentinel ---------------------------------------------------------------------------


def test_production_refuses_a_remote_sentinel_without_a_password_and_example_passwords() -> None:
    remote = "sentinel://s1.internal:26379/0;sentinel://s2.internal:26379/0"
    out = load_production(CELERY_BROKER_URL=remote, CELERY_BROKER_SENTINEL_MASTER=MASTER)
    assert "CELERY_BROKER_URL has no password and its host (s1.internal) is not local" in refusal(
        out
    )
    example = "sentinel://:pw@s1.internal:26379/0;sentinel://:change-me-redis@s2.internal:26379/0"
    out = load_production(CELERY_BROKER_URL=example, CELERY_BROKER_SENTINEL_MASTER=MASTER)
    assert "CELERY_BROKER_URL carries a development or example password" in refusal(out)
    strong = "sentinel://:Zq2Lm5Xv9Rb3@s1.internal:26379/0;sentinel://s2.internal:26379/0"
    out = load_production(CELERY_BROKER_URL=strong, CELERY_BROKER_SENTINEL_MASTER=MASTER)
    assert out.returncode == 0, out.stderr[-800:]
