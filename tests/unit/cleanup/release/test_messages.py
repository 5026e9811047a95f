"""The release message contract (cleanup.release.messages): values no column can hold are
malformed, the largest storable ones valid; a batch keeps each hold's key, rejects bad items
alone, and is malformed without items."""

from __future__ import annotations

import pytest
from django.utils import timezone

from cleanup.release.messages import MalformedMessage, build_batch, validate, validate_batch
from tests.support.wire import GOOD


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


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"reservation_id": 2**63, "idempotency_key": f"release:{2**63}:1"}, "reservation_id"),
        ({"reservation_id": 2**64, "idempotency_key": f"release:{2**64}:1"}, "reservation_id"),
        ({"version": 2**31, "idempotency_key": "release:1:2147483648"}, "version"),
        ({"version": 2**40, "idempotency_key": f"release:1:{2**40}"}, "version"),
        ({"shard": 2**31}, "shard"),
        ({"trace_id": "\ud800"}, "'trace_id' is not valid Unicode"),
        ({"trace_id": "a\x00b"}, "'trace_id' contains a NUL"),
        ({"expires_at": "2026-01-01T00:00:00+00:00\x00"}, "'expires_at' contains a NUL"),
    ],
)
def test_values_no_column_can_hold_are_malformed(changes: dict, words: str) -> None:
    with pytest.raises(MalformedMessage, match=words.replace("(", r"\(")):
        validate({**GOOD, **changes})


def test_the_largest_storable_values_are_valid() -> None:
    rid, version = 2**63 - 1, 2**31 - 1
    message = validate(
        {
            **GOOD,
            "reservation_id": rid,
            "version": version,
            "idempotency_key": f"release:{rid}:{version}",
        }
    )
    assert (message.reservation_id, message.version) == (rid, version)
