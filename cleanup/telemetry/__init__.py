"""Telemetry: the counters the pipeline writes (Prometheus metrics, the per-key delivery count)
and the worker's metrics serving. A leaf: of cleanup it imports only ``models`` and
``redis_clients``."""
