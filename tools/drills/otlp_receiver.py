"""An OTLP/HTTP trace receiver for tests and benchmarks: what a collector would be sent.

``Receiver`` listens on a free loopback port (``endpoint``), answers every export with 200 and
keeps its body; the spans are decoded when read (``spans``, ``named``, ``trace``), so a benchmark
that only counts them spends no CPU decoding while it measures. Use it as a context manager.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    role: str  # the exporting process's ``cleanup.role`` resource attribute
    attributes: dict[str, Any]
    # (trace id, span id, attributes) of each link
    links: tuple[tuple[str, str, dict[str, Any]], ...] = ()


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in pairs}


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ExportTraceServiceRequest."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    found = []
    for resource_spans in request.resource_spans:
        role = str(_attributes(resource_spans.resource.attributes).get("cleanup.role"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                links = tuple(
                    (link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                    for link in span.links
                )
                found.append(
                    ReceivedSpan(
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        span.name,
                        role,
                        _attributes(span.attributes),
                        links,
                    )
                )
    return found


class Receiver:
    """An OTLP/HTTP trace receiver on a free loopback port."""

    def __init__(self) -> None:
        self._bodies: list[bytes] = []
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.exports = 0
        self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._lock:
                    receiver._bodies.append(body)
                    receiver.exports += 1
                    receiver.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far (decoding what arrived since the last read)."""
        with self._lock:
            bodies, self._bodies = self._bodies, []
        decoded = [span for body in bodies for span in decode(body)]
        with self._lock:
            self._spans.extend(decoded)
            return list(self._spans)

    def named(self, name: str, **attributes: Any) -> list[ReceivedSpan]:
        return [
            s
            for s in self.spans
            if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
        ]

    def with_request_id(self, request_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.attributes.get("http.request_id") == request_id]

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]
