"""The pipeline's counters and histograms (cleanup.metrics): the known label values, a batch's
observations and outcomes counted per hold, and a duplicate release counted as already
handled."""

from __future__ import annotations

import pytest
from django.test import Client

from reservations.models import Reservation
from tests.support.fleet import create_eligible_holds
from tests.support.metrics import scrape

# Every test starts and ends with the tests' own Redis database empty.
pytestmark = pytest.mark.usefixtures("broker")


def test_known_label_values_cover_the_dead_letter_reasons_and_tasks() -> None:
    """Counters created at 0 when a worker starts: every dead-letter reason and every cleanup
    task, so retries and dead letters show 0, not nothing, on a healthy fleet."""
    import cleanup.tasks  # noqa: F401 - registers the tasks
    from cleanup import metrics
    from cleanup.models import DeadLetter
    from config.celery_app import app as current_app

    assert set(metrics.KNOWN_DEAD_LETTER_REASONS) == set(DeadLetter.Reason.values)
    registered = {name for name in current_app.tasks if name.startswith("cleanup.")}
    assert set(metrics.KNOWN_TASKS) == registered
    metrics.initialize_worker_series()
    samples = {
        (s.name, s.labels.get("reason") or s.labels.get("task"))
        for family in [*metrics.RETRIES.collect(), *metrics.DEAD_LETTERS.collect()]
        for s in family.samples
    }
    assert ("reservation_cleanup_retries_total", "cleanup.release_reservation") in samples
    assert ("reservation_cleanup_dead_letters_total", "deliveries_exhausted") in samples


@pytest.mark.parametrize("amount", [0.0, 0.004, 0.005, 0.3, 7.5, 1e9])
@pytest.mark.parametrize("times", [1, 2, 500])
def test_observing_an_amount_n_times_at_once_records_what_n_observations_do(
    amount: float, times: int
) -> None:
    """A batch message records its holds' shared duration at once (``observe_times``, which
    writes prometheus_client's histogram fields itself): the exposition must be exactly that of
    ``times`` calls of ``observe``, at a bucket's bound, between bounds and past the last."""
    from prometheus_client import CollectorRegistry, Histogram

    from cleanup.metrics import observe_times

    def samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        # every sample but the histogram's creation time
        return [
            (s.name, s.labels, s.value)
            for family in registry.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        ]

    one_by_one, at_once = CollectorRegistry(), CollectorRegistry()
    buckets = (0.005, 0.05, 0.5, 5.0)
    calls = Histogram("h", "h", buckets=buckets, registry=one_by_one)
    batch = Histogram("h", "h", buckets=buckets, registry=at_once)
    for _ in range(times):
        calls.observe(amount)
    observe_times(batch, amount, times)
    batched, called = samples(at_once), samples(one_by_one)
    # the same samples; the sum up to float rounding (n additions against one product)
    assert [(name, labels) for name, labels, _ in batched] == [(n, lb) for n, lb, _ in called]
    assert [value for *_, value in batched] == pytest.approx([value for *_, value in called])


def test_a_batchs_outcomes_count_each_hold() -> None:
    from prometheus_client import REGISTRY

    from cleanup import metrics

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    before = (
        value("reservation_cleanup_outcomes_total", {"outcome": "released"}),
        value("reservation_cleanup_transitions_total"),
        value("reservation_cleanup_processing_duration_seconds_count"),
    )
    metrics.record_outcome("released", 0.002, 1.5, holds=37)
    after = (
        value("reservation_cleanup_outcomes_total", {"outcome": "released"}),
        value("reservation_cleanup_transitions_total"),
        value("reservation_cleanup_processing_duration_seconds_count"),
    )
    assert [b - a for a, b in zip(before, after, strict=True)] == [37, 37, 37]


@pytest.mark.django_db(transaction=True)
def test_a_duplicate_release_is_counted_as_already_handled_and_moves_no_transition(
    client: Client, settings, run_task
) -> None:
    """What an operator reads on /metrics after a duplicate delivery: one release, one
    duplicate, one transition (a duplicate counted as released would hide the duplicates and
    inflate the transitions)."""
    from cleanup.release.messages import build
    from cleanup.release.publish import RELEASE_TASK

    settings.METRICS_TOKEN = "t" * 40
    outcome = "reservation_cleanup_outcomes_total"
    watched = {
        "released": (outcome, (("outcome", "released"),)),
        "already_handled": (outcome, (("outcome", "already_handled"),)),
        "transitions": ("reservation_cleanup_transitions_total", ()),
    }

    def read() -> dict[str, float]:
        m = scrape(client, "t" * 40)
        return {name: m.get(key, 0.0) for name, key in watched.items()}

    (hold_id,) = create_eligible_holds(1, offerings=1)
    expires_at = Reservation.objects.get(pk=hold_id).expires_at
    message = build(hold_id, 1, expires_at, 0, "duplicate")
    before = read()
    # when: the same release message is delivered twice (a redelivery after a lost ack)
    first = run_task(RELEASE_TASK, message, task_id="first")
    second = run_task(RELEASE_TASK, dict(message), task_id="second")
    assert (first["outcome"], second["outcome"]) == ("released", "already_handled")
    # then
    after = read()
    moved = {name: after[name] - before[name] for name in watched}
    assert moved == {"released": 1, "already_handled": 1, "transitions": 1}
