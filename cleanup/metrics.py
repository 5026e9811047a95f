"""The pipeline's Prometheus counters and histograms, and the small functions that record them
(workers and web alike). The web process's scrape-time gauges are in
``cleanup.operations.console.gauges``; the sizing policy behind ``desired_consumers`` is in
``cleanup.operations.scaling.capacity``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from cleanup import metrics_boot, wire

# In a celery worker, PROMETHEUS_MULTIPROC_DIR and prometheus_client's value class must be set
# before the first metric below is constructed (docs/LIBRARY-NOTES.md §3), whoever imports this
# module first.
metrics_boot.ensure_prepared()

PREFIX = "reservation_cleanup"

DELIVERY_ATTEMPTS = Counter(
    f"{PREFIX}_delivery_attempts", "Deliveries of a cleanup message to task code", ["task"]
)
OUTCOMES = Counter(f"{PREFIX}_outcomes", "Terminal outcomes of release attempts", ["outcome"])
TRANSITIONS = Counter(f"{PREFIX}_transitions", "Holds actually moved to released")
RETRIES = Counter(f"{PREFIX}_retries", "Transient failures scheduled for retry", ["task"])
DEAD_LETTERS = Counter(f"{PREFIX}_dead_letters", "Dead letters recorded", ["reason"])
CLAIMED = Counter(f"{PREFIX}_claimed", "Holds claimed by sweeps", ["shard"])
PUBLISHED = Counter(
    f"{PREFIX}_published", "Holds published in release messages by sweeps", ["shard"]
)
PUBLISHED_MESSAGES = Counter(
    f"{PREFIX}_published_messages", "Release messages published by sweeps", ["shard"]
)
# One observation per published message: _count is messages, _sum is holds.
HOLDS_PER_MESSAGE = Histogram(
    f"{PREFIX}_holds_per_message",
    "Holds carried by each release message a sweep published",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
RELEASE_SIZING = Counter(
    f"{PREFIX}_release_sizing_decisions",
    "Adaptive release sizing decisions of the sweeps (one per claimed batch), by reason",
    ["reason"],
)
# "livemostrecent", not "mostrecent": in a worker every pool process that touches a metric
# writes this labelless gauge's file, and the compactor removes dead processes' files only for
# the live* modes, so with "mostrecent" each recycled pool process left a file behind forever
# (the directory, and every scrape, grew with the recycles). The value of a process that has
# since exited goes with it; the decisions counter above keeps the history.
RELEASE_SIZE_CHOSEN = Gauge(
    f"{PREFIX}_release_size_chosen",
    "Holds per message the most recent adaptive sizing decision of a running process chose",
    multiprocess_mode="livemostrecent",
)
BACKPRESSURE_PAUSES = Counter(
    f"{PREFIX}_backpressure_pauses", "Sweeps that stopped because the queue was deep", ["shard"]
)
# The outbox relay (cleanup.release.outbox): the events queue's depth as the relay last read
# it ("livemostrecent" for the reason given at RELEASE_SIZE_CHOSEN), the rounds it relayed
# nothing because that depth reached CLEANUP_EVENTS_QUEUE_MAX_LENGTH, and the events the
# retention deleted without their ever being relayed.
EVENTS_QUEUE_DEPTH = Gauge(
    f"{PREFIX}_events_queue_depth",
    "Messages waiting in the events queue (CLEANUP_EVENTS_QUEUE) when the relay last read it",
    multiprocess_mode="livemostrecent",
)
OUTBOX_RELAY_HELD_BACK = Counter(
    f"{PREFIX}_outbox_relay_held_back",
    "Outbox relay rounds that relayed nothing: the events queue held "
    "CLEANUP_EVENTS_QUEUE_MAX_LENGTH messages or more",
)
OUTBOX_EVENTS_EXPIRED = Counter(
    f"{PREFIX}_outbox_events_expired",
    "Outbox events deleted by the retention without ever being relayed "
    "(older than CLEANUP_RETENTION_DAYS)",
)
PROCESSING_DURATION = Histogram(
    f"{PREFIX}_processing_duration_seconds",
    "Time in task code per release message",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ENQUEUE_TO_ACK = Histogram(
    f"{PREFIX}_enqueue_to_ack_seconds",
    "From publish (enqueued_at header) to the end of processing",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
BROKER_ENTRIES_SKIPPED = Counter(
    f"{PREFIX}_broker_entries_skipped",
    "Broker entries a reader skipped as unreadable or absurd (docs/HARDENING.md), by reader",
    ["reader"],
)
SWEEP_DURATION = Histogram(
    f"{PREFIX}_sweep_duration_seconds",
    "Duration of one sweep run of a shard",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

BROKER_KEYS_SET_ASIDE = Counter(
    f"{PREFIX}_broker_keys_set_aside",
    "Broker keys of the wrong type a process renamed out of the way (docs/HARDENING.md), by key",
    ["key"],
)

CONTROL_DROPS = Counter(
    f"{PREFIX}_control_messages_dropped",
    "Remote-control and other broadcast messages a worker dropped unread, by reason",
    ["reason"],
)

# The W3C trace headers (traceparent, tracestate) a worker dropped from a task message because
# they were malformed; the message itself still runs (cleanup.broker.screening).
TRACE_HEADERS_DROPPED = Counter(
    f"{PREFIX}_trace_headers_dropped",
    "Malformed W3C trace headers a worker dropped from task messages, by header",
    ["header"],
)

AUTOSCALE_DECISIONS = Counter(
    f"{PREFIX}_autoscale_decisions",
    "Pool autoscaler decisions (cleanup.operations.scaling.autoscale), by action and reason",
    ["action", "reason"],
)
# Written by the worker's main process only; "livemax" keeps one series per worker instance
# without a pid label (each instance has its own metrics directory and port).
AUTOSCALE_POOL = Gauge(
    f"{PREFIX}_autoscale_pool_processes",
    "Pool processes of this worker when the autoscaler last decided",
    multiprocess_mode="livemax",
)
AUTOSCALE_TARGET = Gauge(
    f"{PREFIX}_autoscale_target_processes",
    "Pool size the autoscaler wants for this worker (within --autoscale MIN..MAX)",
    multiprocess_mode="livemax",
)

# The web's requests (cleanup.operations.request_metrics). ``route`` is the URL pattern that
# matched ("api/v1/holds/<int:hold_id>"), never the path: ids would make one series per hold.
HTTP_REQUESTS = Counter(
    f"{PREFIX}_http_requests",
    "Web requests answered, by URL route, method and status code",
    ["route", "method", "status"],
)
HTTP_REQUEST_DURATION = Histogram(
    f"{PREFIX}_http_request_duration_seconds",
    "Time to answer a web request, by URL route and method",
    ["route", "method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


# Label values known in advance. A labelled counter has no series until its first increment, so
# a panel or rule over retries or dead letters would show nothing (not 0) on a healthy fleet;
# the worker's main process creates these at 0 when it starts serving its metrics.
KNOWN_TASKS = wire.TASKS
KNOWN_DEAD_LETTER_REASONS = (
    "malformed",
    "unknown_task",
    "rejected",
    "retries_exhausted",
    "deliveries_exhausted",
    "claims_exhausted",
    "time_limit",
    "failed",
    "periodic_failed",
    "misrouted",
    "unsigned",
)
# The reasons cleanup.worker.remote_control and the Redis transport drop a control message for,
# and the broker readers that skip entries (tests/unit/project/test_deploy.py checks these against
# the calls in the code): the alerts on both counters need a series to read 0 from.
KNOWN_CONTROL_DROP_REASONS = ("malformed", "not_allowed", "undecodable", "not_an_envelope")
KNOWN_SKIP_READERS = ("queue_age", "queue_depth", "unacked_count", "unacked_restore")


def initialize_worker_series() -> None:
    for task in KNOWN_TASKS:
        DELIVERY_ATTEMPTS.labels(task=task)
        RETRIES.labels(task=task)
    for reason in KNOWN_DEAD_LETTER_REASONS:
        DEAD_LETTERS.labels(reason=reason)
    for reason in KNOWN_CONTROL_DROP_REASONS:
        CONTROL_DROPS.labels(reason=reason)
    for reader in KNOWN_SKIP_READERS:
        BROKER_ENTRIES_SKIPPED.labels(reader=reader)
    for header in ("traceparent", "tracestate"):
        TRACE_HEADERS_DROPPED.labels(header=header)
    # kombu's ack bookkeeping keys: the quarantine alert reads 0 from them until a key is planted
    for key in ("unacked", "unacked_index"):
        BROKER_KEYS_SET_ASIDE.labels(key=key)


def record_autoscale_decision(action: str, reason: str, current: int, target: int) -> None:
    AUTOSCALE_DECISIONS.labels(action=action, reason=reason).inc()
    AUTOSCALE_POOL.set(current)
    AUTOSCALE_TARGET.set(target)


def record_delivery(task: str) -> None:
    DELIVERY_ATTEMPTS.labels(task=task).inc()


def record_outcome(
    outcome: str, duration_s: float | None, queue_age_s: float | None, holds: int = 1
) -> None:
    """``holds`` release attempts that ended in ``outcome``: the holds of one batch message
    that ended alike share its per-hold duration and its queue age, so they are recorded at
    once (each value written once, not once per hold: a multiprocess value write takes a lock
    and touches a file, six of them per hold)."""
    if holds < 1:
        return
    OUTCOMES.labels(outcome=outcome).inc(holds)
    if outcome == "released":
        TRANSITIONS.inc(holds)
    if duration_s is not None:
        observe_times(PROCESSING_DURATION, duration_s, holds)
    if queue_age_s is not None and duration_s is not None:
        observe_times(ENQUEUE_TO_ACK, queue_age_s + duration_s, holds)


def observe_times(histogram: Histogram, amount: float, times: int) -> None:
    """What ``times`` calls of ``histogram.observe(amount)`` record (the sum grows by the amount
    each time, the first bucket whose bound is at least the amount by one), in two value
    writes. prometheus_client has no call for it; this reads ``observe``'s own fields, and
    tests/unit/cleanup/operations/console/test_endpoints.py checks the two still record the same."""
    if times == 1:
        histogram.observe(amount)
        return
    wrapped: Any = histogram  # its value fields are not part of the typed interface
    wrapped._raise_if_not_observable()
    wrapped._sum.inc(amount * times)
    for bucket, bound in zip(wrapped._buckets, wrapped._upper_bounds, strict=True):
        if amount <= bound:
            bucket.inc(times)
            break


def record_retry(task: str) -> None:
    RETRIES.labels(task=task).inc()


def record_dead_letter(reason: str) -> None:
    DEAD_LETTERS.labels(reason=reason).inc()


def record_control_drop(reason: str) -> None:
    CONTROL_DROPS.labels(reason=reason).inc()


def record_trace_header_dropped(header: str) -> None:
    TRACE_HEADERS_DROPPED.labels(header=header).inc()


def record_skipped_entry(reader: str) -> None:
    BROKER_ENTRIES_SKIPPED.labels(reader=reader).inc()


def record_key_quarantined(key: str) -> None:
    BROKER_KEYS_SET_ASIDE.labels(key=key).inc()


def record_events_queue_depth(depth: int, held_back: bool) -> None:
    EVENTS_QUEUE_DEPTH.set(depth)
    if held_back:
        OUTBOX_RELAY_HELD_BACK.inc()


def record_events_expired(count: int) -> None:
    OUTBOX_EVENTS_EXPIRED.inc(count)


def record_message_sizes(sizes: list[int]) -> None:
    for size in sizes:
        HOLDS_PER_MESSAGE.observe(size)


def record_sizing(reason: str, size: int) -> None:
    RELEASE_SIZING.labels(reason=reason).inc()
    RELEASE_SIZE_CHOSEN.set(size)


def record_sweep(
    shard: int,
    claimed: int,
    published: int,
    duration_s: float,
    backpressure: bool,
    messages: int | None = None,
) -> None:
    CLAIMED.labels(shard=str(shard)).inc(claimed)
    PUBLISHED.labels(shard=str(shard)).inc(published)
    PUBLISHED_MESSAGES.labels(shard=str(shard)).inc(published if messages is None else messages)
    if backpressure:
        BACKPRESSURE_PAUSES.labels(shard=str(shard)).inc()
    SWEEP_DURATION.observe(duration_s)
