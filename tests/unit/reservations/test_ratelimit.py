"""API rate limits: a sliding window in a real Redis, the RateLimit header fields, no database
write per request, what the API does when the limiter's Redis is down (fails open), and a
limiter behind Redis Sentinel."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from reservations import ratelimit
from reservations.models import ApiToken
from tests.support.api import call, error_code
from tests.support.fleet import wait_until
from tests.support.sentinel import MASTER

pytestmark = pytest.mark.usefixtures("api_token")

WRITES = ("INSERT", "UPDATE", "DELETE")


def availability(offering: Any) -> str:
    return f"/api/v1/offerings/{offering.pk}/availability"


def test_every_answer_states_the_policy_and_what_is_left(client, offering, make_client):
    _, token = make_client(requests_per_minute=3)
    answers = [call(client, "get", availability(offering), token) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    for answer in answers:
        assert answer["RateLimit-Policy"] == '"default";q=3;w=60'
    remaining = [a["RateLimit"].split(";")[1] for a in answers]
    assert remaining == ["r=2", "r=1", "r=0", "r=0"]
    refused = answers[-1]
    assert error_code(refused) == "rate_limited"
    reset = int(refused["Retry-After"])
    assert 1 <= reset <= 60
    assert refused["RateLimit"] == f'"default";r=0;t={reset}'
    # over the limit, any request is refused before anything else is looked at
    assert call(client, "get", "/api/v1/holds?bad=1", token).status_code == 429


def test_the_window_slides_and_never_lets_more_than_the_limit_through(
    client, offering, make_client, monkeypatch
):
    # given a window of 2 s (the policy's 60 s, shortened) and a limit of 4
    monkeypatch.setattr(ratelimit, "WINDOW_SECONDS", 2)
    api_client, token = make_client(requests_per_minute=4)
    url = availability(offering)

    def burst(count: int) -> list[int]:
        """``count`` requests counted at once, from as many threads (each with its own Redis
        connection, as separate web processes would be): their answers' statuses."""

        def one(_: int) -> int:
            decision = ratelimit.check(api_client.pk, 4)
            assert decision is not None
            return 200 if decision.allowed else 429

        with ThreadPoolExecutor(count) as pool:
            return sorted(pool.map(one, range(count)))

    # when 12 arrive at once: 4 go through
    started = time.monotonic()
    assert burst(12) == [200] * 4 + [429] * 8
    # then half a window later, still none (a fixed window might have begun a new count)
    time.sleep(max(0.0, started + 1.0 - time.monotonic()))
    assert call(client, "get", url, token).status_code == 429
    # and once the first ones are a window old, again exactly the limit
    time.sleep(max(0.0, started + 2.3 - time.monotonic()))
    assert burst(12) == [200] * 4 + [429] * 8


def test_an_authenticated_request_writes_nothing_to_the_database(client, offering, make_client):
    # given a token used a moment ago
    _, token = make_client(requests_per_minute=100)
    url = availability(offering)
    with CaptureQueriesContext(connection) as first:
        assert call(client, "get", url, token).status_code == 200
    # when it is used again within the minute
    with CaptureQueriesContext(connection) as later:
        for _ in range(5):
            assert call(client, "get", url, token).status_code == 200
    # then its first use recorded last_used_at (one UPDATE), the next ones wrote nothing
    assert [q["sql"].split()[0] for q in first if q["sql"].lstrip().startswith(WRITES)] == [
        "UPDATE"
    ]
    assert [q["sql"] for q in later if q["sql"].lstrip().startswith(WRITES)] == []
    # and a minute later the next use is recorded again
    ApiToken.objects.update(last_used_at=timezone.now() - timedelta(days=1))
    with CaptureQueriesContext(connection) as stale:
        assert call(client, "get", url, token).status_code == 200
    assert sum(1 for q in stale if q["sql"].lstrip().startswith("UPDATE")) == 1
    last_used = ApiToken.objects.get().last_used_at
    assert last_used is not None and last_used > timezone.now() - timedelta(minutes=1)


# --- the limiter's Redis down -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A redis-server of this test's own (stopped by the test), its URL and a stop function."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def stop() -> None:
        process.terminate()
        process.wait(timeout=10)

    wait_until(up, timeout=10, what="the private redis-server to listen")
    try:
        yield f"redis://127.0.0.1:{port}/0", stop
    finally:
        if process.poll() is None:
            stop()


def test_with_its_redis_down_the_api_answers_unlimited_logs_and_counts_it(
    client, offering, make_client, settings, private_redis, caplog, monkeypatch
):
    # given a limiter on a Redis of its own, and a client with one request a minute
    url_of_redis, stop_redis = private_redis
    settings.RESERVATIONS_API_RATE_LIMIT_REDIS_URL = url_of_redis
    monkeypatch.setattr(ratelimit, "_down_until", 0.0)
    _, token = make_client(requests_per_minute=1)
    url = availability(offering)
    assert call(client, "get", url, token).status_code == 200
    assert call(client, "get", url, token).status_code == 429
    failures_before = ratelimit.FAILURES._value.get()
    # when that Redis stops
    stop_redis()
    answers = [call(client, "get", url, token) for _ in range(3)]
    # then the requests are answered (fail open), with no RateLimit fields to promise anything
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert all("RateLimit" not in a for a in answers)
    # one warning for the outage, not one per request; every unchecked request counted
    warnings = [r for r in caplog.records if r.name == "reservations.ratelimit"]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
    assert "not limited" in warnings[0].getMessage()
    assert ratelimit.FAILURES._value.get() - failures_before == 3


def test_without_any_redis_the_limits_are_not_enforced_and_check_warns(settings):
    from django.core import checks

    settings.RESERVATIONS_API_RATE_LIMIT_REDIS_URL = ""
    settings.CLEANUP_COUNTER_REDIS_URL = ""
    assert ratelimit.check(1, 1) is None
    found = [m.id for m in checks.run_checks() if (m.id or "").startswith("reservations.")]
    assert found == ["reservations.W001"]


# --- behind Redis Sentinel --------------------------------------------------------------------


def test_a_sentinel_url_counts_in_the_master_the_sentinels_name(
    client, offering, make_client, settings, private_sentinel, monkeypatch
):
    # given: the limiter's Redis is a sentinel:// URL (as the counter Redis is on a Sentinel
    # broker), with the master's name
    settings.RESERVATIONS_API_RATE_LIMIT_REDIS_URL = private_sentinel.url
    settings.CELERY_BROKER_SENTINEL_MASTER = MASTER
    monkeypatch.setattr(ratelimit, "_down_until", 0.0)
    api_client, token = make_client(requests_per_minute=2)
    # when
    answers = [call(client, "get", availability(offering), token) for _ in range(3)]
    # then: limited, and counted in that master
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert private_sentinel.master().zcard(f"{ratelimit.KEY_PREFIX}{api_client.pk}") == 2


def test_a_sentinel_url_without_the_masters_name_is_a_check_error(settings):
    from django.core import checks

    settings.RESERVATIONS_API_RATE_LIMIT_REDIS_URL = "sentinel://127.0.0.1:26379/0"
    settings.CELERY_BROKER_SENTINEL_MASTER = ""
    found = [m for m in checks.run_checks() if (m.id or "").startswith("reservations.")]
    assert [m.id for m in found] == ["reservations.E002"]
    assert "CELERY_BROKER_SENTINEL_MASTER is not set" in found[0].msg
    assert "the API rate limiter's Redis" in found[0].msg
