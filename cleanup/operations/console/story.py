""" "Why is hold X still held?" in one place: the hold's versions, claims, deliveries, receipts,
dead letters, outbox events and trace ids, in time order, and a one-line verdict.

Used by ``manage.py explain_hold <id>`` and by the hold's admin page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cleanup import sql
from cleanup.conf import cleanup_settings
from cleanup.models import CleanupReceipt, DeadLetter
from cleanup.release import delivery_cap
from cleanup.release.messages import idempotency_key
from reservations.db import scalar
from reservations.models import OutboxEvent, Reservation


@dataclass
class Story:
    reservation_id: int
    found: bool
    events: list[tuple[datetime, str]] = field(default_factory=list)
    deliveries: dict[str, int] = field(default_factory=dict)
    trace_ids: list[str] = field(default_factory=list)
    verdict: str = ""

    def lines(self) -> list[str]:
        out = [f"hold #{self.reservation_id}"]
        for when, text in self.events:
            out.append(f"  {when.isoformat(timespec='seconds')}  {text}")
        if self.deliveries:
            counts = ", ".join(f"{k}: {n}" for k, n in self.deliveries.items())
            out.append(f"  redeliveries counted per key: {counts}")
        if self.trace_ids:
            out.append(f"  trace ids: {', '.join(self.trace_ids)}")
        out.append(f"verdict: {self.verdict}")
        return out

    def text(self) -> str:
        return "\n".join(self.lines())


def _db_now() -> datetime:
    return scalar(sql.DATABASE_NOW)  # type: ignore[no-any-return]


_NEVER = datetime.max.replace(tzinfo=UTC)


def _secs(delta: Any) -> int:
    return int(delta.total_seconds())


def explain(reservation_id: int) -> Story:
    story = Story(reservation_id=reservation_id, found=False)
    hold = Reservation.objects.filter(pk=reservation_id).first()
    receipts = list(CleanupReceipt.objects.filter(reservation_id=reservation_id).order_by("id"))
    letters = list(DeadLetter.objects.filter(reservation_id=reservation_id).order_by("id"))
    if hold is None:
        story.verdict = f"no hold #{reservation_id}" + (
            f" (but {len(receipts)} receipts / {len(letters)} dead letters mention it)"
            if receipts or letters
            else ""
        )
        return story
    story.found = True
    now = _db_now()
    events: list[tuple[datetime, int, str]] = []  # (time, order, text)
    events.append(
        (hold.created_at, 0, f"created v1 on offering #{hold.offering_id} (bucket {hold.bucket})")
    )
    for ev in OutboxEvent.objects.filter(reservation_id=reservation_id).order_by("id"):
        detail = ""
        if isinstance(ev.payload, dict) and ev.payload.get("expires_at"):
            detail = f", expires_at {ev.payload['expires_at']}"
        published = (
            f"published {ev.published_at.isoformat(timespec='seconds')}"
            if ev.published_at
            else "not yet published"
        )
        events.append(
            (ev.created_at, 1, f"event #{ev.pk} {ev.kind} v{ev.version}{detail}; {published}")
        )
    for r in receipts:
        age = "" if r.queue_age_seconds is None else f", queued {r.queue_age_seconds:.1f}s"
        events.append(
            (
                r.created_at,
                2,
                f"receipt {r.idempotency_key} → {r.outcome} (attempt {r.attempt}, worker "
                f"{r.worker or '?'}, task {r.task_id or '?'}, trace {r.trace_id or '?'}{age})",
            )
        )
    for d in letters:
        state = (
            f"resolved {d.resolved_at.isoformat(timespec='seconds')} ({d.resolution})"
            if d.resolved_at
            else "OPEN"
        )
        events.append(
            (
                d.created_at,
                3,
                f"dead letter #{d.pk} {d.reason} v{d.version} trace {d.trace_id or '?'}: "
                f"{d.error[:160]} [{state}]",
            )
        )
    if hold.last_claimed_at:
        events.append(
            (
                hold.last_claimed_at,
                4,
                f"last claimed (claim {hold.claim_count}) by sweep trace {hold.last_trace_id}",
            )
        )
    if hold.released_at:
        events.append(
            (
                hold.released_at,
                5,
                f"released at v{hold.released_version} (reason {hold.release_reason or '?'})",
            )
        )
    events.sort(key=lambda e: (e[0], e[1]))
    story.events = [(when, text) for when, _, text in events]
    try:
        for v in range(1, hold.version + 1):
            story.deliveries[idempotency_key(reservation_id, v)] = delivery_cap.current(
                idempotency_key(reservation_id, v)
            )
    except Exception as exc:  # noqa: BLE001 - the counter store is optional for the story
        story.deliveries = {"unavailable": 0}
        story.events.append((now, f"delivery counters unavailable: {exc!r}"[:200]))
    traces = [hold.last_trace_id] + [r.trace_id for r in receipts] + [d.trace_id for d in letters]
    story.trace_ids = list(dict.fromkeys(t for t in traces if t))
    # A set-aside hold's 'infinity' loads as datetime.max (reservations.db): "never".
    next_attempt_at = None if hold.next_attempt_at == _NEVER else hold.next_attempt_at
    story.verdict = _verdict(hold, next_attempt_at, receipts, letters, now)
    return story


def _verdict(
    hold: Reservation,
    next_attempt_at: datetime | None,
    receipts: list[CleanupReceipt],
    letters: list[DeadLetter],
    now: datetime,
) -> str:
    status = hold.status
    if status == Reservation.Status.RELEASED:
        by = next(
            (r for r in receipts if r.outcome == "released" and r.version == hold.released_version),
            None,
        )
        if by is not None:
            return (
                f"released at v{hold.released_version} by task {by.task_id or '?'} "
                f"(trace {by.trace_id or '?'}) on {by.worker or '?'}"
            )
        return (
            f"released at v{hold.released_version} ({hold.release_reason or 'no reason'}), "
            f"not by a cleanup message (no receipt): inline or admin release"
        )
    if status in (Reservation.Status.CONFIRMED, Reservation.Status.CANCELLED):
        return f"not held: {status} at v{hold.version}; the cleanup has nothing to do"
    renewed = (
        f" (renewed {hold.version - 1} times, now v{hold.version})" if hold.version > 1 else ""
    )
    if hold.expires_at > now:
        return (
            f"held, not expired until {hold.expires_at.isoformat(timespec='seconds')} "
            f"(in {_secs(hold.expires_at - now)} s){renewed}"
        )
    eligible_for = _secs(now - hold.expires_at)
    open_letters = [d for d in letters if d.resolved_at is None]
    set_aside = next_attempt_at is None or hold.claim_count > cleanup_settings().max_claims
    if set_aside:
        letter = next(
            (d for d in open_letters if d.reason == DeadLetter.Reason.CLAIMS_EXHAUSTED),
            open_letters[-1] if open_letters else None,
        )
        if letter is not None:
            return (
                f"set aside after {hold.claim_count} claims: dead letter #{letter.pk} — run "
                f"requeue_dead_letters --id {letter.pk}"
            )
        return (
            f"set aside after {hold.claim_count} claims, no open dead letter — eligible for "
            f"{eligible_for} s; reschedule it (cleanup.release.claim.reschedule_claim)"
        )
    if hold.claim_count == 0:
        return (
            f"eligible for {eligible_for} s, never claimed{renewed}: is beat running and is "
            f"the sweep of its shard enabled? (bucket {hold.bucket})"
        )
    last_trace = hold.last_trace_id or "?"
    extra = ""
    if open_letters:
        d = open_letters[-1]
        extra = f"; open dead letter #{d.pk} ({d.reason}) — requeue_dead_letters --id {d.pk}"
    next_at = next_attempt_at.isoformat(timespec="seconds") if next_attempt_at else "never"
    return (
        f"eligible for {eligible_for} s, claimed {hold.claim_count} times, last trace "
        f"{last_trace}, next attempt at {next_at}{renewed}{extra}"
    )
