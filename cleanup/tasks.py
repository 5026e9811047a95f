"""Thin Celery tasks. Each takes small JSON values, calls a service, returns counts.

Their delivery policy (bounded deliveries, dead letters, retries) is ``CleanupTask``'s, in
``cleanup.release.delivery``; their names are ``cleanup.wire``'s.
"""

from __future__ import annotations

import time
from typing import Any

from cleanup import tracing
from cleanup.broker.celery_app import app
from cleanup.operations import samples
from cleanup.release import dead_letters, outbox
from cleanup.release.delivery import RELEASE_TASK_OPTIONS, CleanupTask, queue_age
from cleanup.release.messages import MalformedMessage, validate, validate_batch
from cleanup.release.release import run_attempt
from cleanup.release.sweep import record_last_sweep, sweep_shard
from cleanup.wire import (
    PRUNE_TASK,
    RELAY_OUTBOX_TASK,
    RELEASE_BATCH_TASK,
    RELEASE_TASK,
    SAMPLE_HEALTH_TASK,
    SWEEP_TASK,
)
from reservations import idempotency


@app.task(name=RELEASE_TASK, **RELEASE_TASK_OPTIONS)
def release_reservation_task(self: CleanupTask, message: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    age = queue_age(self.request)
    try:
        parsed = validate(message)
    except MalformedMessage as exc:
        return self.dead_letter_malformed(exc, message, age)
    return run_attempt(parsed, self.attempt(age), started)


@app.task(name=RELEASE_BATCH_TASK, **RELEASE_TASK_OPTIONS)
def release_batch_task(self: CleanupTask, message: dict[str, Any]) -> dict[str, Any]:
    """Batched mode: one message, many holds, one transaction; per-hold outcomes. Each
    malformed item is dead-lettered on its own; the valid ones are released."""
    started = time.perf_counter()
    age = queue_age(self.request)
    try:
        batch = validate_batch(message)
    except MalformedMessage as exc:
        return self.dead_letter_malformed(exc, message, age)
    self.dead_letter_rejected(batch, age)
    if not batch.items:
        return {"outcomes": {}, "rejected": len(batch.rejected)}
    return run_attempt(batch, self.attempt(age), started)


@app.task(bind=True, base=CleanupTask, name=SWEEP_TASK, periodic=True)
def sweep_shard_task(self: CleanupTask, shard: int, shards: int) -> dict[str, Any]:
    # The run's trace id (on its messages, receipts and log lines) is the OpenTelemetry trace's
    # when tracing is on (cleanup.tracing), so both name the same fan-out; the task id if not.
    result = sweep_shard(shard, shards, trace_id=tracing.current_trace_id() or self.request.id)
    record_last_sweep(result)  # the health page's "last sweep" of this shard
    return result.as_dict()


@app.task(bind=True, base=CleanupTask, name=RELAY_OUTBOX_TASK, periodic=True)
def relay_outbox_task(self: CleanupTask) -> dict[str, Any]:
    return {"published": outbox.relay_batch()}


@app.task(bind=True, base=CleanupTask, name=PRUNE_TASK, periodic=True)
def prune_task(self: CleanupTask) -> dict[str, Any]:
    counts = outbox.prune()
    counts["health_samples"] = samples.prune_samples()
    counts["idempotency_keys"] = idempotency.prune_expired()
    return counts


@app.task(bind=True, base=CleanupTask, name=SAMPLE_HEALTH_TASK, periodic=True)
def sample_health_task(self: CleanupTask) -> dict[str, Any]:
    """Health upkeep (beat entry "cleanup: sample health", every 30 s): dead letters that a
    later release settled are resolved first, so the sample's open count is what still needs
    a person; open letters beyond ``CLEANUP_DEAD_LETTER_OPEN_CAP`` are summarised; then one
    point of the health page's chart."""
    resolved = dead_letters.resolve_released()
    summarised = dead_letters.summarise_beyond_cap()
    sample = samples.take_sample()
    return {
        "dead_letters_resolved": resolved,
        "dead_letters_summarised": summarised,
        "sample": sample.pk,
    }
