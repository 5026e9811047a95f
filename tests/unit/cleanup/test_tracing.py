"""Traces (cleanup.tracing), in process with the SDK's in-memory exporter: one trace from the
sweep through every release message it publishes to each release's outcome; the trace headers a
worker admits; log lines and the API's request span joined to the trace; nothing installed when
no endpoint is set. docs/TRACING.md."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any
from unittest.mock import ANY

import pytest
from celery import current_app
from celery.app.trace import build_tracer
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from django.utils import timezone
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cleanup import tracing
from cleanup.broker import screening
from cleanup.conf import cleanup_settings
from cleanup.release.messages import build, build_batch, validate, validate_batch
from cleanup.release.release import Attempt, run_attempt
from cleanup.wire import RELEASE_BATCH_TASK, RELEASE_TASK, SWEEP_TASK
from cleanup.worker import consumer
from config.logging import JsonFormatter, KeyValueFormatter, TraceContextLogFilter
from reservations import services
from reservations.models import Reservation
from reservations.problems import RequestIdLogFilter
from tests.support.holds import expire, seed_expired
from tests.support.metrics import counter

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process as in a worker's pool process, spans kept in memory."""
    exporter = InMemorySpanExporter()
    with tracing._reset_for_tests():
        assert tracing.configure("worker", exporter=exporter)
        yield exporter


def run_as_worker(name: str, headers: dict[str, Any], args: list[Any], kwargs: dict) -> Any:
    """Run a task as a worker's pool process does: Celery's tracer with the request built from
    the message's headers (where the trace context travels), signals and all."""
    import cleanup.tasks  # noqa: F401  (registers the project's tasks with the app)

    task = current_app.tasks[name]
    request = {**headers, "hostname": "test-worker", "delivery_info": {"routing_key": "x"}}
    run = build_tracer(name, task, app=current_app, eager=True, propagate=True)
    return run(headers["id"], args, kwargs, request).retval


def queued(queue: str, broker: Any) -> list[tuple[dict[str, Any], list[Any], dict]]:
    """The messages waiting in a Redis queue: (headers, args, kwargs) each."""
    out = []
    for raw in broker.lrange(queue, 0, -1):
        envelope = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
        out.append((envelope["headers"], args, kwargs))
    return out


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


@pytest.mark.django_db(transaction=True)
def test_one_trace_runs_from_the_sweep_through_each_message_to_its_release(
    spans: InMemorySpanExporter, broker: Any, settings: Any, caplog: Any
) -> None:
    # given: two due holds, one hold per message
    settings.CLEANUP_RELEASE_MODE = "single"
    ids = seed_expired(2, seconds_ago=60, offerings=1)
    spans.clear()  # the seeding's statements, each a trace of its own on a traced connection
    # when: beat's message runs the sweep, and a worker runs each release message it published
    result = run_as_worker(
        SWEEP_TASK, {"id": "sweep-1", "task": SWEEP_TASK}, [], {"shard": 0, "shards": 1}
    )
    messages = queued(cleanup_settings().release_queue, broker)
    assert result["published"] == 2 and len(messages) == 2
    caplog.handler.addFilter(TraceContextLogFilter())  # as the console handler has it
    with caplog.at_level(logging.INFO, logger="cleanup.tasks"):
        for headers, args, kwargs in messages:
            run_as_worker(RELEASE_TASK, headers, args, kwargs)
    # then: every span is in the sweep's trace, and the sweep's trace id is the project's too
    named = by_name(spans)
    (sweep,) = named["cleanup.sweep"]
    trace_id = sweep.context.trace_id
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {trace_id}
    assert result["trace_id"] == format(trace_id, "032x")
    assert sweep.attributes["cleanup.published"] == 2
    # the sweep's own steps are its children
    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}

    def parent(span: Any) -> Any:
        return by_id[span.parent.span_id]

    for step in ("cleanup.sweep.admission", "cleanup.sweep.claim"):
        assert all(parent(s) is sweep for s in named[step])
    (publish,) = named["cleanup.sweep.publish"]
    assert parent(publish).name == "cleanup.sweep.claim"
    # each release: release span ← its task's run span ← the publish span of its message
    releases = named["cleanup.release"]
    assert sorted(s.attributes["reservation.id"] for s in releases) == sorted(ids)
    for release in releases:
        assert release.attributes["release.outcome"] == "released"
        assert release.attributes["reservation.version"] == 1
        run = parent(release)
        assert run.name == f"run/{RELEASE_TASK}"
        assert parent(parent(run)) is publish  # apply_async/<task> in between
    assert set(Reservation.objects.filter(pk__in=ids).values_list("status", flat=True)) == {
        "released"
    }
    # the release attempt lines carry the trace's id and their release's run span's
    lines = [r for r in caplog.records if r.getMessage() == "release attempt"]
    assert len(lines) == 2
    runs = {format(parent(s).context.span_id, "016x") for s in releases}
    assert {record.trace_id for record in lines} == {format(trace_id, "032x")}
    assert {record.span_id for record in lines} == runs


@pytest.mark.django_db(transaction=True)
def test_a_batch_release_span_names_each_hold_with_its_version_and_outcome(
    spans: InMemorySpanExporter, broker: Any, settings: Any
) -> None:
    settings.CLEANUP_RELEASE_MODE = "batch"
    ids = seed_expired(3, seconds_ago=60, offerings=1)
    run_as_worker(SWEEP_TASK, {"id": "sweep-b", "task": SWEEP_TASK}, [], {"shard": 0, "shards": 1})
    ((headers, args, kwargs),) = queued(cleanup_settings().release_queue, broker)
    run_as_worker(RELEASE_BATCH_TASK, headers, args, kwargs)
    (release,) = by_name(spans)["cleanup.release"]
    (sweep,) = by_name(spans)["cleanup.sweep"]
    assert release.context.trace_id == sweep.context.trace_id
    attributes = dict(release.attributes or {})
    assert sorted(attributes["reservation.ids"]) == sorted(ids)
    assert attributes["reservation.versions"] == (1, 1, 1)
    assert attributes["release.outcomes"] == ("released",) * 3
    assert attributes["cleanup.holds"] == 3


@pytest.mark.django_db(transaction=True)
def test_a_malformed_traceparent_is_dropped_and_counted_and_the_release_still_runs(
    spans: InMemorySpanExporter, broker: Any, settings: Any
) -> None:
    settings.CLEANUP_RELEASE_MODE = "single"
    seed_expired(1, seconds_ago=60, offerings=1)
    run_as_worker(SWEEP_TASK, {"id": "sweep-2", "task": SWEEP_TASK}, [], {"shard": 0, "shards": 1})
    ((headers, args, kwargs),) = queued(cleanup_settings().release_queue, broker)
    headers["traceparent"] = "00-" + "f" * 32 + "-" + "a" * 16 + "-01;evil"
    headers["tracestate"] = "vendor=value"
    before = [counter("trace_headers_dropped", header=h) for h in ("traceparent", "tracestate")]
    # the worker's consumer screens the headers before Celery reads them
    assert consumer.drop_malformed_trace_headers(headers) == ["traceparent", "tracestate"]
    after = [counter("trace_headers_dropped", header=h) for h in ("traceparent", "tracestate")]
    assert after == [before[0] + 1, before[1] + 1]
    assert "traceparent" not in headers and "tracestate" not in headers
    spans.clear()
    result = run_as_worker(RELEASE_TASK, headers, args, kwargs)
    assert result["outcome"] == "released"
    # the release ran as a trace of its own: nothing of the forged id was trusted
    (release,) = by_name(spans)["cleanup.release"]
    assert release.context.trace_id != int("f" * 32, 16)


@pytest.mark.parametrize(
    ("headers", "dropped"),
    [
        ({"traceparent": TRACEPARENT}, []),
        ({"traceparent": TRACEPARENT, "tracestate": "a=1,b@c=2, ro=x y"}, []),
        ({"traceparent": TRACEPARENT.upper()}, ["traceparent"]),
        ({"traceparent": TRACEPARENT + "-00"}, ["traceparent"]),  # a future version's tail
        ({"traceparent": "00-" + "0" * 32 + TRACEPARENT[35:]}, ["traceparent"]),
        ({"traceparent": TRACEPARENT[:36] + "0" * 16 + "-01"}, ["traceparent"]),
        ({"traceparent": "ff" + TRACEPARENT[2:]}, ["traceparent"]),
        ({"traceparent": 7}, ["traceparent"]),
        ({"traceparent": ["a"] * 10_000}, ["traceparent"]),
        ({"traceparent": TRACEPARENT, "tracestate": "x=" + "a" * 600}, ["tracestate"]),
        ({"traceparent": TRACEPARENT, "tracestate": ",".join(["k=v"] * 33)}, ["tracestate"]),
        ({"traceparent": TRACEPARENT, "tracestate": "no equals"}, ["tracestate"]),
        ({"traceparent": TRACEPARENT, "tracestate": {"k": "v"}}, ["tracestate"]),
        ({"tracestate": "k=v"}, ["tracestate"]),  # means nothing without a traceparent
        ({"traceparent": "bad", "tracestate": "k=v"}, ["traceparent", "tracestate"]),
    ],
)
def test_only_well_formed_trace_headers_are_kept(
    headers: dict[str, Any], dropped: list[str]
) -> None:
    kept = {k: v for k, v in headers.items() if k not in dropped}
    assert screening.drop_malformed_trace_headers(headers) == dropped
    assert headers == kept


def test_the_trace_headers_are_among_what_the_publisher_sets() -> None:
    assert {"traceparent", "tracestate"} <= screening.PUBLISHER_HEADERS


def test_log_lines_inside_a_span_carry_its_ids_and_others_none(
    spans: InMemorySpanExporter,
) -> None:
    def record(**extra: Any) -> logging.LogRecord:
        made = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
        made.__dict__.update(extra)
        TraceContextLogFilter().filter(made)
        return made

    outside = record(trace_id="untraced-sweep")
    with tracing.span("test.outer") as span:
        context = span.get_span_context()
        inside = record()
        same = record(trace_id=format(context.trace_id, "032x"))
        other = record(trace_id="a-requeued-message")
    assert vars(outside)["trace_id"] == "untraced-sweep" and not hasattr(outside, "span_id")
    line = json.loads(JsonFormatter().format(inside))
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")
    assert json.loads(JsonFormatter().format(same)) == {**line, "ts": ANY}
    assert json.loads(JsonFormatter().format(other)) == {
        **line,
        "ts": ANY,
        "message_trace_id": "a-requeued-message",
    }
    assert "trace_id=" + line["trace_id"] in KeyValueFormatter().format(other)


@pytest.mark.django_db
def test_the_api_request_span_names_the_request_id_and_its_log_lines_the_trace(
    api_token: str, caplog: Any
) -> None:
    exporter = InMemorySpanExporter()
    with tracing._reset_for_tests():
        assert tracing.configure("web", exporter=exporter)
        client = Client()  # loads the middleware now, the instrumentation's first
        # the console handler's filters (config/settings/base.py), at emit time
        caplog.handler.addFilter(RequestIdLogFilter())
        caplog.handler.addFilter(TraceContextLogFilter())
        with caplog.at_level(logging.INFO):
            response = client.get(
                "/api/v1/holds/999999999",
                HTTP_AUTHORIZATION=f"Bearer {api_token}",
                HTTP_X_REQUEST_ID="trace-me-1",
            )
    assert response.status_code == 404
    (request_span,) = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert dict(request_span.attributes or {})["http.request_id"] == "trace-me-1"
    # Django's "Not Found" line (logged after the span ended) names the request's trace
    (line,) = [r for r in caplog.records if getattr(r, "request_id", None) == "trace-me-1"]
    assert line.trace_id == format(request_span.context.trace_id, "032x")
    assert line.span_id == format(request_span.context.span_id, "016x")


def test_with_the_endpoint_set_and_the_packages_missing_the_start_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with tracing._reset_for_tests(), pytest.raises(ImproperlyConfigured, match=r"\[tracing\]"):
        tracing.configure("worker", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"})


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": ""},
        {"OTEL_SERVICE_NAME": "x"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"},
    ],
)
def test_tracing_is_off_unless_an_endpoint_is_set(environ: dict[str, str]) -> None:
    assert not tracing.enabled(environ)
    assert tracing.enabled({**environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x"}) == (
        "OTEL_SDK_DISABLED" not in environ
    )


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, False),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            True,
        ),
    ],
)
def test_the_exporter_variable_is_honoured(environ: dict[str, str], on: bool) -> None:
    assert tracing.enabled(environ) is on


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4317",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            },
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ),
    ],
)
def test_an_exporter_or_protocol_not_supported_stops_the_start_naming_the_variable(
    environ: dict[str, str], named: str
) -> None:
    with pytest.raises(ImproperlyConfigured, match=named):
        tracing.configure("worker", environ=environ)


def test_the_console_exporter_is_the_sdks_and_otlp_the_default() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    assert isinstance(tracing._exporter({"OTEL_TRACES_EXPORTER": "console"}), ConsoleSpanExporter)
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}
    assert isinstance(tracing._exporter(endpoint), OTLPSpanExporter)


OFF_PROBE = """
import django
django.setup()
import config.wsgi  # the web process, as gunicorn loads it
from django.conf import settings
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.instrumentation.django import DjangoInstrumentor
from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
from cleanup import tracing
from cleanup.worker import signals
signals.trace_the_pool_process()  # a pool process starting
print(type(trace.get_tracer_provider()).__name__)
print([i().is_instrumented_by_opentelemetry for i in
       (DjangoInstrumentor, CeleryInstrumentor, PsycopgInstrumentor)])
print(any("opentelemetry" in m for m in settings.MIDDLEWARE))
print(tracing.span("x") is tracing.span("y"), tracing.current_trace_id())
"""


def test_without_an_endpoint_no_provider_and_no_instrumentation_is_installed() -> None:
    import os

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OTEL_") and not k.startswith("SENTRY_")
    }
    env["DJANGO_SETTINGS_MODULE"] = "config.settings.test"
    out = subprocess.run(
        [sys.executable, "-c", OFF_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:4] == [
        "ProxyTracerProvider",
        "[False, False, False]",
        "False",
        "True None",
    ]


def test_a_test_that_traced_leaves_the_process_as_it_found_it() -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    with tracing._reset_for_tests():
        tracing.configure("worker", exporter=InMemorySpanExporter())
        assert tracing.is_on() and CeleryInstrumentor().is_instrumented_by_opentelemetry
    assert not tracing.is_on() and not CeleryInstrumentor().is_instrumented_by_opentelemetry
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"


def request_traceparent(span: Any) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["single", "batch"])
def test_a_release_links_to_the_api_request_that_last_renewed_each_hold(
    api_token: str, offering: Any, path: str
) -> None:
    exporter = InMemorySpanExporter()
    auth: dict[str, Any] = {
        "HTTP_AUTHORIZATION": f"Bearer {api_token}",
        "content_type": "application/json",
    }
    with tracing._reset_for_tests():
        assert tracing.configure("web", exporter=exporter)
        client = Client()
        # given: a hold taken and then renewed through the API, one taken by a seeding
        # command (no request), and a hold taken through the API and never renewed
        renewed = client.post(
            f"/api/v1/offerings/{offering.pk}/holds", {"holder": "ann", "ttl_seconds": 60}, **auth
        ).json()["id"]
        client.post(f"/api/v1/holds/{renewed}/renew", {"expected_version": 1}, **auth)
        taken = client.post(
            f"/api/v1/offerings/{offering.pk}/holds", {"holder": "bob", "ttl_seconds": 60}, **auth
        ).json()["id"]
        take_renewed, renew, take = [
            s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER
        ]
        seeded = services.hold_seat(offering.pk, "cy", 60).pk
        rows = dict(Reservation.objects.values_list("pk", "request_traceparent"))
        assert rows == {
            renewed: request_traceparent(renew),
            taken: request_traceparent(take),
            seeded: "",
        }
        expire(renewed, taken, seeded)
        exporter.clear()
        # when: the worker releases them
        holds = [(renewed, 2), (taken, 1), (seeded, 1)]
        raw = (
            [build(i, v, timezone.now(), 0, "t") for i, v in holds]
            if path == "single"
            else [build_batch([(i, v, timezone.now()) for i, v in holds], 0, "t")]
        )
        for message in raw:
            validated = validate(message) if path == "single" else validate_batch(message)
            run_attempt(validated, Attempt(1, "w@h", "task", 0.1), 0.0)
    # then: each release span links to the request that took or last renewed its hold
    links = {
        dict(link.attributes or {})["reservation.id"]: (link.context.trace_id, link.context.span_id)
        for span in by_name(exporter)["cleanup.release"]
        for link in span.links
    }
    assert links == {
        renewed: (renew.context.trace_id, renew.context.span_id),
        taken: (take.context.trace_id, take.context.span_id),
    }
    assert take_renewed.context.span_id not in {span_id for _, span_id in links.values()}
    assert set(Reservation.objects.values_list("status", flat=True)) == {"released"}
