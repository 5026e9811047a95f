"""Metrics as the tests read them: a scrape of the web's /metrics, a counter of this process,
the pause gauges of the web's collector, the fleet's backlog reading made older."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import F
from django.test import Client
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from cleanup.models import BacklogReading
from cleanup.operations.console.gauges import BacklogCollector


def scrape(client: Client, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample /metrics serves with ``token``: (name, sorted labels) -> value."""
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    out = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counter(name: str, **labels: str) -> float:
    """This process's ``reservation_cleanup_<name>_total`` with ``labels`` (0 before any)."""
    return REGISTRY.get_sample_value(f"reservation_cleanup_{name}_total", labels) or 0.0


def pause_gauges() -> dict[str, float]:
    """The ``reservation_cleanup_releases_paused*`` gauges, as a scrape reads them."""
    return {
        m.name: m.samples[0].value
        for m in BacklogCollector().collect()
        if m.name.startswith("reservation_cleanup_releases_paused")
    }


def age_the_reading(seconds: float) -> None:
    """Make the fleet's reading of the eligible backlog ``seconds`` older, so that the next
    scrape past the interval reads again."""
    BacklogReading.objects.update(read_at=F("read_at") - timedelta(seconds=seconds))
