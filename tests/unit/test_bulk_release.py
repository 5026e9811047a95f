"""The batched mode decides every hold exactly as the per-reservation mode would."""

from datetime import timedelta

from django.utils import timezone

from cleanup.pipeline.messages import MalformedMessage, build_batch, validate_batch
from reservations import services
from reservations.services import ReleaseOutcome
from reservations.services import release_holds as release_many_if_expired


def _scenario(offering_capacity: int = 10):
    """Holds in every state the outcome order distinguishes; returns (offering, items)."""
    offering = services.create_offering("bulk", offering_capacity)
    expired = [services.hold_seat(offering.pk, f"h{i}", 60) for i in range(6)]
    fresh = services.hold_seat(offering.pk, "fresh", 600)
    services.renew(expired[1].pk, 1, 120)  # now v2; a v1 message is stale
    renewed = services.renew(expired[5].pk, 1, 120)  # v2, expires within the later clock
    services.confirm(expired[2].pk, 1)
    services.cancel(expired[3].pk, 1)
    items = [
        (expired[0].pk, 1),  # released
        (expired[1].pk, 1),  # renewed (version moved while held)
        (expired[2].pk, 1),  # no_longer_held (confirmed)
        (expired[3].pk, 1),  # no_longer_held (cancelled)
        (fresh.pk, 1),  # not_expired at the later clock? no: fresh expires in 600 s
        (999_999, 1),  # not_found
        (expired[4].pk, 1),  # released
        (renewed.pk, 2),  # renewed hold at its new version, expired by the clock → released
    ]
    return offering, items


def test_bulk_release_gives_each_hold_the_outcome_it_would_get_alone(db):
    # given two identical worlds, judged at a clock past the short holds but not the fresh one
    later = timezone.now() + timedelta(seconds=300)
    _, bulk_items = _scenario()
    _, single_items = _scenario()
    # when
    bulk = release_many_if_expired(bulk_items, now=later)
    single = [services.release_if_expired(rid, v, now=later) for rid, v in single_items]
    # then: same outcome, position by position
    assert [bulk[rid] for rid, _ in bulk_items] == single
    assert [bulk[rid] for rid, _ in bulk_items] == [
        ReleaseOutcome.RELEASED,
        ReleaseOutcome.RENEWED,
        ReleaseOutcome.NO_LONGER_HELD,
        ReleaseOutcome.NO_LONGER_HELD,
        ReleaseOutcome.NOT_EXPIRED,
        ReleaseOutcome.NOT_FOUND,
        ReleaseOutcome.RELEASED,
        ReleaseOutcome.RELEASED,
    ]
    # and a second pass finds them released at this version
    again = release_many_if_expired(bulk_items, now=later)
    assert again[bulk_items[0][0]] == ReleaseOutcome.ALREADY_HANDLED
    assert services.seat_conservation_violations() == []


def test_a_batch_message_keeps_each_holds_key_and_rejects_bad_items_alone():
    now = timezone.now()
    raw = build_batch([(1, 1, now), (2, 3, now)], shard=0, trace_id="t")
    raw["items"].append({"reservation_id": "x", "version": 1})
    batch = validate_batch(raw)
    assert [m.idempotency_key for m in batch.items] == ["release:1:1", "release:2:3"]
    assert len(batch.rejected) == 1
    assert "must be an integer" in batch.rejected[0][1]


def test_a_batch_without_items_is_malformed():
    raw = build_batch([], shard=0, trace_id="t")
    try:
        validate_batch(raw)
    except MalformedMessage as exc:
        assert "items" in str(exc)
    else:
        raise AssertionError("an empty batch must be malformed")
