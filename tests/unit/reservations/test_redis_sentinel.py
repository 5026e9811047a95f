"""Redis Sentinel URLs (reservations.redis_sentinel): a sentinel broker selects the screened
Sentinel transport with the master's name, and a Sentinel setting the project cannot support is
refused at start-up naming the variable. The transport itself:
cleanup/worker/test_redis_transport.py; the failover:
tests/integration/test_sentinel_failover.py."""

from __future__ import annotations

import json

import pytest

from tests.support.child_python import run_with
from tests.support.sentinel import MASTER, TRANSPORT


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {"CELERY_BROKER_URL": "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380"},
            "CELERY_BROKER_URL is a sentinel:// URL but CELERY_BROKER_SENTINEL_MASTER is not set",
        ),
        (
            {"CELERY_BROKER_SENTINEL_MASTER": MASTER},
            "CELERY_BROKER_SENTINEL_MASTER is set but neither CELERY_BROKER_URL nor "
            "CLEANUP_COUNTER_REDIS_URL is a sentinel:// URL",
        ),
        (
            {
                "CELERY_BROKER_URL": "sentinel://127.0.0.1:26379;redis://127.0.0.1:6379/0",
                "CELERY_BROKER_SENTINEL_MASTER": MASTER,
            },
            "CELERY_BROKER_URL (entry 2): every entry of a Sentinel URL must be sentinel://",
        ),
        (
            {
                "CELERY_BROKER_URL": "sentinel://127.0.0.1:26379/0?ssl_cert_reqs=required",
                "CELERY_BROKER_SENTINEL_MASTER": MASTER,
            },
            "CELERY_BROKER_URL (entry 1): options in a sentinel:// URL are not supported",
        ),
        (
            {
                "CELERY_BROKER_URL": "sentinel://127.0.0.1:26379/0",
                "CELERY_BROKER_SENTINEL_MASTER": MASTER,
                "REDIS_TLS_VERIFY": "required",
            },
            "REDIS_TLS_VERIFY is set but CELERY_BROKER_URL is a sentinel:// URL: TLS to Sentinel "
            "is not supported",
        ),
        (
            {
                "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
                "CLEANUP_COUNTER_REDIS_URL": "sentinel://127.0.0.1:26379/x",
                "CELERY_BROKER_SENTINEL_MASTER": MASTER,
            },
            "CLEANUP_COUNTER_REDIS_URL (entry 1): the database 'x' is not a number",
        ),
        (
            {"CELERY_BROKER_URL": "redis+socket:///tmp/redis.sock"},
            "CELERY_BROKER_URL: expected a redis://, rediss://, sentinel:// or amqp:// URL",
        ),
    ],
)
def test_a_sentinel_setting_the_project_cannot_support_is_refused_naming_the_variable(
    env: dict[str, str], words: str
) -> None:
    out = run_with("import django; django.setup()", **env)
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]


def test_a_sentinel_broker_selects_the_screened_sentinel_transport_with_the_master_name() -> None:
    code = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps([s.CELERY_BROKER_TRANSPORT, s.CELERY_BROKER_TRANSPORT_OPTIONS, "
        "s.BROKER_IS_REDIS, s.CLEANUP_COUNTER_REDIS_URL]))"
    )
    url = "sentinel://:pw@127.0.0.1:26379/2;sentinel://localhost:26380/2"
    out = run_with(code, CELERY_BROKER_URL=url, CELERY_BROKER_SENTINEL_MASTER=MASTER)
    assert out.returncode == 0, out.stderr[-800:]
    transport, options, is_redis, counters = json.loads(out.stdout)
    assert transport == TRANSPORT
    assert options["master_name"] == MASTER
    assert is_redis is True
    assert counters == url  # the delivery counters follow the master through the sentinels too
