"""Request metrics of the web under gunicorn with several worker processes: one scrape, answered
by whichever process, shows every process's requests by route, method and status."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from reservations import clients, services
from reservations.models import ApiClient
from tests.support.fleet import parse, total

pytestmark = [pytest.mark.slow]

METRICS_TOKEN = "web-metrics-test-token-0123456789abcdef"
NOT_FOUND, FOUND = 30, 20
MAX_ROUNDS = 10


@pytest.fixture
def metrics_dir(tmp_path: Path) -> Path:
    return tmp_path / "web-metrics"


@pytest.fixture
def web_options(metrics_dir: Path) -> dict[str, Any]:
    return {
        "workers": 2,
        "threads": 1,
        "worker_class": "sync",
        "WEB_METRICS_DIR": str(metrics_dir),
        "METRICS_TOKEN": METRICS_TOKEN,
    }


def test_one_scrape_counts_every_worker_processs_requests_by_route_and_status(web, metrics_dir):
    # given requests answered by both gunicorn workers: 404s for a hold and 200s for an offering
    offering = services.create_offering("metrics", capacity=1)
    token = clients.issue_token(ApiClient.objects.create(name="m", all_offerings=True))
    auth = {"Authorization": f"Bearer {token}"}
    paths = ["/api/v1/holds/999999"] * NOT_FOUND + [
        f"/api/v1/offerings/{offering.pk}/availability"
    ] * FOUND
    # Rounds of concurrent requests until both processes have answered some: on a loaded
    # machine one process can take a whole round while the other is still busy or booting.
    rounds = 0
    writers: set[str] = set()
    with ThreadPoolExecutor(8) as pool:
        while len(writers) < 2 and rounds < MAX_ROUNDS:
            rounds += 1
            statuses = list(pool.map(lambda p: web.request("GET", p, None, auth).status, paths))
            assert sorted(statuses) == [200] * FOUND + [404] * NOT_FOUND
            writers = {f.name.rsplit("_", 1)[-1] for f in metrics_dir.glob("counter_*.db")}
    assert len(writers) >= 2, f"only {writers} counted {rounds} rounds of requests"
    # when Prometheus scrapes, several times (each scrape may reach either worker)
    for _ in range(4):
        scrape = web.request("GET", "/metrics", None, {"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert scrape.status == 200
        samples = parse(scrape.body.decode())
        # then every scrape shows all the requests, by route and status
        name = "reservation_cleanup_http_requests_total"
        not_found = total(samples, name, route="api/v1/holds/<int:hold_id>", status="404")
        assert not_found == NOT_FOUND * rounds
        availability = "api/v1/offerings/<int:offering_id>/availability"
        assert (
            total(samples, name, route=availability, status="200", method="GET") == FOUND * rounds
        )
        histogram = "reservation_cleanup_http_request_duration_seconds_count"
        assert total(samples, histogram, route=availability) == FOUND * rounds
