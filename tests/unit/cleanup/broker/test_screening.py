"""Bounds every broker message must meet before anything decodes it deeply
(cleanup.broker.screening), checked without a worker: nesting depth and size, the headers and
body Celery reads, the Redis envelope, what the project's publisher would send, compressed
bodies, an unacked entry routed elsewhere, and linear time on adversarial input."""

from __future__ import annotations

import bz2
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kombu.exceptions import ContentDisallowed

from cleanup.broker import screening
from cleanup.broker.screening import parse_unacked
from cleanup.worker import redis_transport
from tests.support.planted import envelope, redis_only
from tests.support.wire import GOOD

# --- screening ----------------------------------------------------------------------------


def test_nesting_depth_counts_brackets_outside_strings_only() -> None:
    assert screening.nesting_depth("[" * 40 + "]" * 40) > screening.MAX_NESTING
    assert screening.nesting_depth(json.dumps(["[" * 1000, {"k": "{" * 1000}])) <= 2
    batch = json.dumps([[{"items": [{"a": 1}] * 1000}], {}, {"chain": None}])
    assert screening.check_raw(batch) is None


def test_oversized_and_overdeep_bodies_are_refused_before_decoding(settings) -> None:
    settings.CLEANUP_MAX_MESSAGE_BYTES = 64 * 1024
    assert "exceeds CLEANUP_MAX_MESSAGE_BYTES" in (
        screening.check_raw(b"x" * (64 * 1024 + 1)) or ""
    )
    assert "nested deeper than 32" in (screening.check_raw(b"[" * 10_000) or "")
    assert screening.check_raw(json.dumps([[GOOD], {}, {}])) is None


@pytest.mark.parametrize(
    ("headers", "words"),
    [
        ({"id": "x", "timelimit": "garbage"}, "timelimit"),
        ({"id": "x", "timelimit": ["a", "b"]}, "timelimit"),
        ({"id": "x", "timelimit": [float("inf"), None]}, "timelimit"),
        ({"id": "x", "timelimit": [1, 2, 3]}, "timelimit"),
        ({"id": "x", "eta": "soon"}, "eta"),
        ({"id": "x", "expires": 5}, "expires"),
        ({"id": "x", "retries": "1"}, "retries"),
        ({"id": "x", "retries": True}, "retries"),
        ({"id": ["x"]}, "'id'"),
        ({}, "'id' is missing"),
        ({"id": "x", "stamped_headers": [1]}, "stamped_headers"),
        ({"id": "x", "replaced_task_nesting": "deep"}, "replaced_task_nesting"),
    ],
)
def test_garbage_in_a_header_celery_reads_is_refused(headers: dict[str, Any], words: str) -> None:
    problem = screening.check_headers(headers)
    assert problem is not None and words in problem


def test_headers_celery_itself_sends_pass() -> None:
    headers: dict[str, Any] = {
        "lang": "py",
        "task": "cleanup.release_reservation",
        "id": "6f1c",
        "shadow": None,
        "eta": "2026-01-01T00:00:00+00:00",
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, 8],
        "root_id": "6f1c",
        "parent_id": None,
        "argsrepr": "({},)",
        "kwargsrepr": "{}",
        "origin": "gen1@host",
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
        "enqueued_at": 1764500000.5,
    }
    assert screening.check_headers(headers) is None


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({"args": [], "kwargs": {}, "embed": {}}, "[args, kwargs, embed]"),
        ([[], {}], "[args, kwargs, embed]"),
        (["x", {}, {}], "args must be a list"),
        ([[], [1, 2], {}], "kwargs must be an object"),
        ([[], {}, "e"], "embed must be an object"),
    ],
)
def test_a_task_body_that_celery_cannot_unpack_is_refused(payload: object, words: str) -> None:
    problem = screening.check_payload(payload)
    assert problem is not None and words in problem
    assert screening.check_payload([[GOOD], {}, None]) is None


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ([1, 2], "a JSON list"),
        ({"body": "e30="}, "'properties'"),
        ({"properties": {"delivery_tag": 1}}, "delivery_tag"),
        ({"properties": {"delivery_tag": "t"}}, "delivery_info"),
        (
            {
                "body": "%%%",
                "properties": {
                    "delivery_tag": "t",
                    "body_encoding": "base64",
                    "delivery_info": {"exchange": "", "routing_key": "cleanup"},
                },
            },
            "base64",
        ),
    ],
)
def test_a_redis_entry_that_is_not_an_envelope_is_refused(entry: object, words: str) -> None:
    problem = screening.check_envelope(entry)
    assert problem is not None and words in problem


def _growth(check: Any, small: bytes, large: bytes, repeats: int = 7) -> float:
    """How many times longer ``large`` takes than ``small``: the best of ``repeats`` timings of
    each, taken in turns so both see the same load on the shared machine."""
    best_small = best_large = float("inf")
    for _ in range(repeats):
        for data in (small, large):
            started = time.perf_counter()
            check(data)
            elapsed = time.perf_counter() - started
            if data is small:
                best_small = min(best_small, elapsed)
            else:
                best_large = min(best_large, elapsed)
    return best_large / max(best_small, 1e-6)


@pytest.mark.parametrize(
    "piece",
    [b'\\"', b'"', b"[", b"[]", b'"\\', b'["', b'{"a":'],
    ids=["escaped quotes", "quotes", "open brackets", "pairs", "quote-backslash", "mixed", "keys"],
)
def test_the_screening_grows_linearly_with_adversarial_input(piece: bytes) -> None:
    # given: adversarial bodies of n and 8n bytes (the n sized so one scan takes milliseconds),
    # each with more brackets than the cap, so the nesting scan runs on the whole body
    small = b"[]" * 40 + b'"' + piece * (32 * 1024 // len(piece))
    large = b"[]" * 40 + b'"' + piece * (8 * 32 * 1024 // len(piece))
    # when: each is screened as a message body and as a broker entry
    for check in (screening.check_raw, redis_transport.screen_broadcast):
        ratio = _growth(check, small, large)
        # then: 8x the input costs about 8x the time; quadratic would be ~64x. The bound sits
        # between the two (geometric middle) so a loaded machine does not trip it.
        assert ratio < 24, f"{check.__name__}: 8x input took {ratio:.1f}x the time"


NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
CELERY_HEADERS: dict[str, Any] = {
    "lang": "py",
    "task": "cleanup.release_reservation",
    "id": "6f1c",
    "shadow": None,
    "eta": None,
    "expires": None,
    "group": None,
    "group_index": None,
    "retries": 0,
    "timelimit": [None, None],
    "root_id": "6f1c",
    "parent_id": None,
    "argsrepr": "({},)",
    "kwargsrepr": "{}",
    "origin": "gen1@host",
    "ignore_result": None,
    "replaced_task_nesting": 0,
    "stamped_headers": None,
    "stamps": {},
    "enqueued_at": NOW.timestamp(),
}
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def _options(headers: dict[str, Any], embed: Any = EMBED) -> str | None:
    return screening.check_publish_options(
        {**CELERY_HEADERS, **headers},
        embed,
        time_limits=(30, 25),
        eta_bound_seconds=30,
        now=NOW,
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"eta": (NOW + timedelta(seconds=30)).isoformat(), "retries": 3},  # a retry's countdown
        {"timelimit": [30, 25]},
        {"expires": (NOW + timedelta(seconds=60)).isoformat()},  # a sweep from beat
        {"periodic_task_name": "cleanup-sweep-0", "redelivered": True},
    ],
    ids=["first publish", "retry", "the worker's limits", "sweep expiry", "beat, restored"],
)
def test_what_the_publisher_sends_passes_the_publish_contract(headers: dict[str, Any]) -> None:
    assert _options(headers) is None


@pytest.mark.parametrize(
    ("headers", "embed", "words"),
    [
        ({"x-attacker": 1}, EMBED, "'x-attacker' is not one the project's publisher sets"),
        ({"group": "g"}, EMBED, "'group' asks for a Celery feature"),
        ({"stamped_headers": ["a"]}, EMBED, "'stamped_headers'"),
        ({"replaced_task_nesting": 3}, EMBED, "replacement"),
        ({}, {**EMBED, "callbacks": [{"task": "x"}]}, "links further tasks (callbacks)"),
        ({}, {**EMBED, "chord": {"task": "x"}}, "links further tasks (chord)"),
        ({}, {**EMBED, "other": 1}, "embed has 'other'"),
        (
            {"eta": (NOW + timedelta(days=1)).isoformat(), "retries": 1},
            EMBED,
            "eta is 86400 s ahead",
        ),
        ({"eta": "2026-12-02T12:00:00", "retries": 1}, EMBED, "eta is 86400 s ahead"),  # naive: UTC
        # only a retry is ever scheduled: an eta on a first delivery is held in memory for nothing
        ({"eta": (NOW + timedelta(seconds=5)).isoformat()}, EMBED, "eta on a first delivery"),
        ({"timelimit": [3600, None]}, EMBED, "hard limit of 3600"),
        ({"timelimit": [None, 26]}, EMBED, "soft limit of 26"),
        ({"expires": (NOW - timedelta(hours=1)).isoformat()}, EMBED, "expires is earlier"),
    ],
)
def test_a_message_asking_for_more_than_the_publisher_would_is_refused(
    headers: dict[str, Any], embed: Any, words: str
) -> None:
    problem = _options(headers, embed)
    assert problem is not None and words in problem


def test_kombu_refuses_a_compressed_body_without_decompressing_it() -> None:
    # given: a bz2 body of 115 bytes that decompresses to 128 MiB
    from kombu import message as kombu_message

    Message: Any = kombu_message.Message  # its stubs declare the body as text
    bomb = bz2.compress(b" " * (128 * 1024 * 1024))
    screening.refuse_compressed_bodies()
    for compression in ("application/x-bz2", "bzip2", "gzip", "zlib", "xz", "no-such-codec"):
        # when: kombu builds the message, as every transport does before any check
        message = Message(body=bomb, headers={"compression": compression})
        # then: the refusal is recorded as a decode error and the body is left as it came
        assert message.errors, compression
        assert message.body == bomb
    with pytest.raises(ContentDisallowed, match="compressed bodies are refused"):
        Message(body=bomb, headers={"compression": "bzip2"})._reraise_error()


# --- an unacked entry routed to another key ---------------------------------------------------


@redis_only
def test_an_unacked_entry_routed_to_another_key_is_refused_for_restore() -> None:
    entry = json.dumps([json.loads(envelope(time.time())), "", "unacked"])
    parsed, problem = parse_unacked(entry)
    assert parsed is None and problem is not None and "routed elsewhere" in problem
