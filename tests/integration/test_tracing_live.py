"""Traces from the real processes (gunicorn, ``celery beat``, ``celery worker``) exported over
OTLP/HTTP to a receiver this test runs: a hold taken through the API and released by beat's sweep
and a worker shows the API's request span (naming the request id and the hold), and one trace
from beat's send through the sweep to the release span naming the hold and its outcome, linked
to the request span. A
release message with a hostile ``traceparent`` is released all the same, the header dropped and
counted once, its forged trace id nowhere. docs/TRACING.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cleanup.release.schedule import install_schedule
from reservations import clients, services
from reservations.models import ApiClient
from tests.support.fleet import (
    beats,
    dedicated,
    free_port,
    log_fields,
    log_lines,
    one_eligible_hold,
    scrape_worker,
    status_of,
    total,
    wait_until,
)
from tests.support.web import gunicorn
from tests.support.wire import RELEASE_TASK, publish_raw, release_message, task_body
from tools.drills.otlp_receiver import ReceivedSpan, Receiver

pytestmark = [pytest.mark.workers]

FORGED_TRACE = "f" * 32
HOSTILE_TRACEPARENT = f"00-{FORGED_TRACE}-{'a' * 16}-01\r\nX-Injected: yes"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as made:
        yield made


def otel_env(receiver: Receiver) -> dict[str, str]:
    # Exports every 200 ms, so the test waits for spans, not for the default 5 s batches.
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}


@dataclass(frozen=True)
class TracedWorker:
    metrics_port: int
    log: Path


@pytest.fixture
def traced_worker(
    clean: None, exclusive_workers: None, tmp_path: Path, receiver: Receiver
) -> Iterator[TracedWorker]:
    """One traced worker (prefork, one pool process): its metrics port and log."""
    port = free_port()
    env = {
        **otel_env(receiver),
        "WORKER_METRICS_PORT": str(port),
        "WORKER_METRICS_DIR": str(tmp_path / "worker-metrics"),
    }
    with dedicated(tmp_path, {"concurrency": 1, "env": env}) as (worker,):
        yield TracedWorker(port, worker.log_path)


def test_a_hold_taken_through_the_api_is_released_in_one_trace_from_beat(
    traced_worker: TracedWorker, receiver: Receiver, tmp_path: Path
) -> None:
    # given: a traced web, worker and beat sweeping every second
    install_schedule(shards=1, every=1)
    offering = services.create_offering("traced", capacity=3)
    token = clients.issue_token(
        ApiClient.objects.create(name="traced", can_write=True, all_offerings=True)
    )
    request_id = f"trace-it-{uuid.uuid4().hex[:8]}"
    with gunicorn(tmp_path, workers=1, threads=2, **otel_env(receiver)) as web:
        # when: a client takes a hold for one second
        answer = web.request(
            "POST",
            f"/api/v1/offerings/{offering.pk}/holds",
            {"holder": "ann", "ttl_seconds": 1},
            {"Authorization": f"Bearer {token}", "X-Request-ID": request_id},
        )
        assert answer.status == 201, answer.body
        hold_id = answer.body["id"]
        # then: the request's span names the request id and the hold
        wait_until(
            lambda: bool(receiver.with_request_id(request_id)),
            timeout=30,
            what="the API request's span",
        )
    (request_span,) = receiver.with_request_id(request_id)
    assert request_span.role == "web"
    assert request_span.attributes["reservation.id"] == hold_id
    with beats(tmp_path, 1, env_overrides=otel_env(receiver)):
        wait_until(lambda: status_of(hold_id) == "released", timeout=60, what="the release")
        wait_until(
            lambda: receiver.named("cleanup.release", **{"reservation.id": hold_id}),
            timeout=30,
            what="the release span",
        )
    # and: the release is in the trace of the sweep that beat sent
    (release,) = receiver.named("cleanup.release", **{"reservation.id": hold_id})
    assert release.attributes["release.outcome"] == "released"
    assert release.attributes["reservation.version"] == 1
    wait_until(
        lambda: (
            {"cleanup.sweep", "cleanup.sweep.publish"}
            <= {s.name for s in receiver.trace(release.trace_id)}
        ),
        timeout=30,
        what="the sweep's spans in the release's trace",
    )
    in_trace = receiver.trace(release.trace_id)
    by_id = {s.span_id: s for s in in_trace}
    roots = [s for s in in_trace if not s.parent_id]
    assert [(s.role, s.name.split("/")[0]) for s in roots] == [("beat", "apply_async")]
    chain = []
    span: ReceivedSpan | None = release
    while span is not None:
        chain.append((span.role, span.name))
        span = by_id.get(span.parent_id)
    assert chain[0] == ("worker", "cleanup.release")
    assert ("worker", "cleanup.sweep.publish") in chain and ("worker", "cleanup.sweep") in chain
    assert chain[-1][0] == "beat"
    # the hold's creation is a trace of its own, linked from the release span
    assert request_span.trace_id != release.trace_id
    assert release.links == (
        (request_span.trace_id, request_span.span_id, {"reservation.id": hold_id}),
    )
    # and: the worker's line for the release names the trace and the release's run span
    (line,) = attempt_lines(traced_worker, hold_id)
    assert line["trace_id"] == release.trace_id
    assert line["span_id"] == by_id[release.parent_id].span_id
    print(f"trace {release.trace_id}: " + " <- ".join(f"{r}:{n}" for r, n in chain))


def test_a_hostile_traceparent_is_dropped_once_and_the_hold_still_released(
    traced_worker: TracedWorker, receiver: Receiver
) -> None:
    # given: an expired hold and its (signed) release message carrying a hostile traceparent
    hold_id, _ = one_eligible_hold()
    body = task_body(release_message(hold_id, 1, trace_id="hostile"))
    publish_raw(
        body,
        task=RELEASE_TASK,
        headers={"traceparent": HOSTILE_TRACEPARENT, "tracestate": "k=v"},
    )
    # then: the hold is released, in a trace of the worker's own
    wait_until(lambda: status_of(hold_id) == "released", timeout=60, what="the release")
    wait_until(
        lambda: receiver.named("cleanup.release", **{"reservation.id": hold_id}),
        timeout=30,
        what="the release span",
    )
    (release,) = receiver.named("cleanup.release", **{"reservation.id": hold_id})
    assert release.attributes["release.outcome"] == "released"
    assert release.trace_id != FORGED_TRACE
    assert [s for s in receiver.spans if s.trace_id == FORGED_TRACE] == []
    # and: the header was dropped and counted once (its tracestate with it)
    samples, _ = scrape_worker(traced_worker.metrics_port)
    name = "reservation_cleanup_trace_headers_dropped_total"
    assert total(samples, name, header="traceparent") == 1
    assert total(samples, name, header="tracestate") == 1
    # the release's log line joins the worker's own trace; the message's claim is kept apart
    (line,) = attempt_lines(traced_worker, hold_id)
    assert line["trace_id"] == release.trace_id and line["message_trace_id"] == "hostile"


def attempt_lines(worker: TracedWorker, hold_id: int) -> list[dict[str, str]]:
    return [
        log_fields(line)
        for line in log_lines([worker.log], "release attempt")
        if log_fields(line).get("reservation_id") == str(hold_id)
    ]
