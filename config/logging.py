"""Log formatters: key=value text for humans, one JSON object per line for machines.

Structured fields travel in ``extra={...}``; both formatters print every extra field.
``TraceContextLogFilter`` adds the current OpenTelemetry span's ``trace_id`` and ``span_id`` to
each record logged inside a span (cleanup.tracing; docs/TRACING.md).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from reservations.tracecontext import otel_trace

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class TraceContextLogFilter(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` (hex, as trace back-ends show them) to every record
    logged inside a recording span, so every such line joins its trace. A record that names a
    ``trace_id`` of its own (the sweep's and the releases' lines: the message's) keeps it when
    it is the span's, as it is for everything a traced sweep published; a different one (a
    message a person or an untraced publisher sent) moves to ``message_trace_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if otel_trace is None:
            return True
        context = otel_trace.get_current_span().get_span_context()
        if context.is_valid:
            trace_id = format(context.trace_id, "032x")
            own = getattr(record, "trace_id", None)
            if own is not None and own != trace_id:
                record.message_trace_id = own
            record.trace_id = trace_id
            record.span_id = format(context.span_id, "016x")
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        payload.update(_extras(record))
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
        fields = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{ts} {record.levelname} {record.name} {record.getMessage()}"
        if fields:
            line = f"{line} {fields}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line
