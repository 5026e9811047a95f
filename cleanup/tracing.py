"""OpenTelemetry traces of the web, the sweeps and the releases, off unless an OTLP endpoint is set.

``configure(role)`` runs once in each process that does the work, after any fork: the web's
WSGI module (in each gunicorn worker), each Celery pool process (``worker_process_init``) and
beat (``beat_init``). With neither ``OTEL_EXPORTER_OTLP_ENDPOINT`` nor
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (or with ``OTEL_SDK_DISABLED=true``, or
``OTEL_TRACES_EXPORTER=none``) it does nothing:
no provider, no instrumentation, and ``span()`` hands back one shared no-op context. Otherwise
it installs a tracer provider with a ``BatchSpanProcessor`` exporting over OTLP/HTTP (the
exporter reads the rest of the standard ``OTEL_*`` variables itself) and instruments Django
(web), Celery (worker, beat) and psycopg.

The OTEL_* variables are the OpenTelemetry specification's, read by its SDK; this module only
reads whether tracing is on and which exporter (``OTEL_TRACES_EXPORTER``: ``otlp`` over HTTP,
``console`` or ``none``), and refuses at start-up what it cannot honour (another exporter, the
gRPC protocol) naming the variable. The packages are the wheel's ``tracing`` extra: with an
endpoint set and the packages missing, start-up fails naming the extra.

Docs: docs/TRACING.md.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

logger = logging.getLogger("cleanup.tracing")

# The specification's variables that turn tracing on (either endpoint) or off (the SDK switch).
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
DISABLED_VARIABLE = "OTEL_SDK_DISABLED"
# The specification's exporter choice: ``otlp`` (the default; over HTTP, the one protocol the
# extra installs), ``console`` (spans printed on stdout, no endpoint needed) or ``none``.
EXPORTER_VARIABLE = "OTEL_TRACES_EXPORTER"
EXPORTERS = ("otlp", "console", "none")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
PROTOCOLS = ("http/protobuf",)
# The service name when OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES) names none.
DEFAULT_SERVICE_NAME = "reservation-cleanup"
EXTRA_HINT = (
    "install the tracing extra (pip install 'reservation-cleanup[tracing]'), or unset "
    "OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
)
# What each process instruments: the web serves requests, beat and the worker publish and run
# tasks; all but beat use the database through psycopg.
ROLES = {
    "web": ("django", "psycopg"),
    "worker": ("celery", "psycopg"),
    "beat": ("celery",),
}
TRACER_NAME = "cleanup"

_lock = threading.Lock()
_configured_pid: int | None = None
_tracer: Any = None
_provider: Any = None
_NO_SPAN = contextlib.nullcontext(None)


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether traces are exported: the SDK is not switched off, and the exporter is OTLP
    with an endpoint set, or the console. A value of ``OTEL_TRACES_EXPORTER`` or of the OTLP
    protocol that this project cannot honour stops the start, naming the variable."""
    if environ.get(DISABLED_VARIABLE, "").strip().lower() == "true":
        return False
    exporter = _exporter_name(environ)
    if exporter == "none":
        return False
    if exporter == "console":
        return True
    if not any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        return False
    for name in PROTOCOL_VARIABLES:
        protocol = environ.get(name, "").strip()
        if protocol and protocol not in PROTOCOLS:
            raise ImproperlyConfigured(
                f"{name}={protocol!r}: traces are exported over OTLP/HTTP only "
                f"({', '.join(PROTOCOLS)}); unset it or set it to http/protobuf"
            )
    return True


def _exporter_name(environ: Mapping[str, str]) -> str:
    # The specification allows a list; one exporter is what a process here runs.
    value = environ.get(EXPORTER_VARIABLE, "").strip().lower() or "otlp"
    if value not in EXPORTERS:
        raise ImproperlyConfigured(
            f"{EXPORTER_VARIABLE}={value!r} is not supported: one of {', '.join(EXPORTERS)}"
        )
    return value


def configure(role: str, *, exporter: Any = None, environ: Mapping[str, str] = os.environ) -> bool:
    """Install tracing in this process for ``role`` (``web``, ``worker``, ``beat``) if it is
    on; whether it is. Once per process: a forked child configures its own (a batch
    processor's export thread does not survive a fork). ``exporter``: the span exporter
    (tests pass an in-memory one, processed synchronously), OTLP/HTTP otherwise."""
    global _configured_pid, _tracer, _provider
    if role not in ROLES:
        raise ValueError(f"unknown tracing role {role!r}; one of {sorted(ROLES)}")
    if exporter is None and not enabled(environ):
        return False
    with _lock:
        if _configured_pid == os.getpid():
            return True
        try:
            from opentelemetry import trace  # noqa: PLC0415 - the optional tracing extra
            from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
            from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
            from opentelemetry.sdk.trace.export import (  # noqa: PLC0415
                BatchSpanProcessor,
                SimpleSpanProcessor,
            )
        except ImportError as exc:
            raise ImproperlyConfigured(_missing(exc)) from exc
        resource = Resource.create(
            {"service.namespace": DEFAULT_SERVICE_NAME, "cleanup.role": role}
        )
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
        provider = TracerProvider(resource=resource)
        if exporter is None:
            provider.add_span_processor(BatchSpanProcessor(_exporter(environ)))
        else:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        _set_provider(trace, provider)
        _instrument(ROLES[role], provider)
        _provider = provider
        _tracer = provider.get_tracer(TRACER_NAME)
        _configured_pid = os.getpid()
    logger.info("tracing on", extra={"role": role})
    return True


def _exporter(environ: Mapping[str, str]) -> Any:
    if _exporter_name(environ) == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter  # noqa: PLC0415

        return ConsoleSpanExporter()
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
    except ImportError as exc:
        raise ImproperlyConfigured(_missing(exc)) from exc
    return OTLPSpanExporter()


def _missing(exc: ImportError) -> str:
    return f"tracing is on but {exc.name} is missing: {EXTRA_HINT}"


def _set_provider(trace: Any, provider: Any) -> None:
    # The API sets its global provider once per process; a forked child inherits the parent's
    # flag (and a test reconfigures), so the new provider replaces it directly.
    trace._TRACER_PROVIDER_SET_ONCE._done = False
    trace.set_tracer_provider(provider)


def _instrument(libraries: tuple[str, ...], provider: Any) -> None:
    # Each instrumentor is a singleton that instruments once per process; a forked child
    # inherits the parent's instrumentation, already pointing at the global provider.
    try:
        if "django" in libraries:
            from opentelemetry.instrumentation.django import (  # noqa: PLC0415
                DjangoInstrumentor,
            )

            if not DjangoInstrumentor().is_instrumented_by_opentelemetry:
                DjangoInstrumentor().instrument(tracer_provider=provider)
        if "celery" in libraries:
            from opentelemetry.instrumentation.celery import (  # noqa: PLC0415
                CeleryInstrumentor,
            )

            if not CeleryInstrumentor().is_instrumented_by_opentelemetry:
                CeleryInstrumentor().instrument(tracer_provider=provider)
        if "psycopg" in libraries:
            from opentelemetry.instrumentation.psycopg import (  # noqa: PLC0415
                PsycopgInstrumentor,
            )

            if not PsycopgInstrumentor().is_instrumented_by_opentelemetry:
                PsycopgInstrumentor().instrument(tracer_provider=provider)
    except ImportError as exc:
        raise ImproperlyConfigured(_missing(exc)) from exc


def shutdown() -> None:
    """Export what is buffered and stop (a pool process or beat on its way out)."""
    if _provider is not None and _configured_pid == os.getpid():
        _provider.shutdown()


def is_on() -> bool:
    return _tracer is not None and _configured_pid == os.getpid()


def span(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A span of this process's tracer as a context manager yielding it, child of the current
    one; with tracing off, a shared no-op context yielding ``None``."""
    if not is_on():
        return _NO_SPAN
    return _tracer.start_as_current_span(name, attributes=dict(attributes or {}))


def set_attributes(current: Any, attributes: Mapping[str, Any]) -> None:
    """Set attributes on a span ``span()`` yielded (nothing with tracing off)."""
    if current is not None:
        current.set_attributes(dict(attributes))


def link_requests(current: Any, traceparents: Mapping[int, str]) -> None:
    """Link a release's span to the request span that took or last renewed each hold it
    released (``{hold id: traceparent}``), the link naming the hold. The SDK keeps at most
    ``OTEL_SPAN_LINK_COUNT_LIMIT`` links (128 by default) of a batch's span; a traceparent that
    does not parse (written by hand) is skipped."""
    if current is None or not traceparents:
        return
    from opentelemetry import trace  # noqa: PLC0415 - installed when tracing is on
    from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
        TraceContextTextMapPropagator,
    )

    propagator = TraceContextTextMapPropagator()
    for hold_id, traceparent in traceparents.items():
        context = trace.get_current_span(
            propagator.extract({"traceparent": traceparent})
        ).get_span_context()
        if context.is_valid:
            current.add_link(context, {"reservation.id": hold_id})


def current_trace_id() -> str | None:
    """The current span's trace id in hex (32 characters), or ``None`` outside a span or with
    tracing off."""
    if not is_on():
        return None
    from opentelemetry import trace  # noqa: PLC0415 - installed when tracing is on

    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


@contextlib.contextmanager
def _reset_for_tests() -> Iterator[None]:
    """Forget this process's configuration on leaving (tests configure with an in-memory
    exporter)."""
    global _configured_pid, _tracer, _provider
    try:
        yield
    finally:
        with _lock:
            if _provider is not None:
                _provider.shutdown()
            _configured_pid = _tracer = _provider = None
            _uninstrument()
            _unset_provider()


def _unset_provider() -> None:
    # Back to the API's proxy: later code in the process sees tracing as never set up.
    try:
        from opentelemetry import trace  # noqa: PLC0415 - the optional tracing extra
    except ImportError:
        return
    trace._TRACER_PROVIDER_SET_ONCE._done = False
    trace._TRACER_PROVIDER = None


def _uninstrument() -> None:
    for module, name in (
        ("opentelemetry.instrumentation.django", "DjangoInstrumentor"),
        ("opentelemetry.instrumentation.celery", "CeleryInstrumentor"),
        ("opentelemetry.instrumentation.psycopg", "PsycopgInstrumentor"),
    ):
        try:
            instrumentor = getattr(importlib.import_module(module), name)()
        except ImportError:
            continue
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
