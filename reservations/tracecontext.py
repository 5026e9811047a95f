"""The current OpenTelemetry span, read where the tracing extra may be missing.

``otel_trace`` is OpenTelemetry's ``trace`` API module, or ``None`` without the extra; with the
extra installed and tracing off (cleanup.tracing), no span is ever valid.
"""

from __future__ import annotations

from typing import Any

otel_trace: Any
try:  # the optional tracing extra; without it no span is ever current
    from opentelemetry import trace as otel_trace
except ImportError:  # pragma: no cover - the locked environments install it
    otel_trace = None


def current_traceparent() -> str:
    """The current span as a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``), or ``""``
    outside a recording span: what a hold records of the request that took or renewed it."""
    if otel_trace is None:
        return ""
    context = otel_trace.get_current_span().get_span_context()
    if not context.is_valid:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
