"""Bounds on hostile input, checked without a worker: message validation ranges, the screening
the consumer and the Redis transport apply, dead letters that are always stored, and receipts
that never block a real release."""

from __future__ import annotations

import bz2
import inspect
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from kombu.exceptions import ContentDisallowed

from cleanup.broker import screening
from cleanup.models import CleanupReceipt, DeadLetter
from cleanup.release import dead_letters
from cleanup.release.messages import MalformedMessage, build, validate
from cleanup.release.release import Attempt, release, release_batch
from cleanup.worker import redis_transport, remote_control
from reservations import services
from reservations.models import Reservation
from tests.support.holds import expire
from tests.support.wire import GOOD

# --- message validation -------------------------------------------------------------------


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


def test_our_redis_read_is_still_kombus_own_with_screening_added() -> None:
    """cleanup.worker.redis_transport copies kombu 5.7's ``Channel._brpop_read`` and ``_get`` and
    adds the screening; when kombu changes them this fails, and the copy must be redone."""
    from kombu.transport import redis

    channel: Any = redis.Channel
    read = inspect.getsource(channel._brpop_read)
    get = inspect.getsource(channel._get)
    assert "self.connection._deliver(loads(bytes_to_str(item)), dest)" in read
    assert "self._flush_brpop_reauth()" in read
    assert "return loads(bytes_to_str(item))" in get
    assert "self._maybe_update_queues_expire(client, queue)" in get


def test_our_unacked_restore_is_still_kombus_own_with_screening_added() -> None:
    """cleanup.worker.redis_transport.ScreenedQoS copies kombu 5.7's ``QoS.restore_by_tag`` with the
    screening in place of the bare decode, and relies on every restore (the visibility scan, a
    requeue, the restore at shutdown) going through it; when kombu changes any of that this
    fails, and the copy must be redone."""
    from kombu.transport import redis

    qos: Any = redis.QoS
    by_tag = inspect.getsource(qos.restore_by_tag)
    assert "M, EX, RK = loads(bytes_to_str(p))  # json is unicode" in by_tag
    assert "self.channel._do_restore_message(M, EX, RK, pipe, leftmost)" in by_tag
    assert "self._remove_from_indices(tag, pipe)" in by_tag
    assert "client.transaction(restore_transaction, self.unacked_key)" in by_tag
    assert "self.restore_by_tag(tag, client)" in inspect.getsource(qos.restore_visible)
    assert "self.restore_by_tag(tag, client=client)" in inspect.getsource(qos.restore_unacked)
    reject = inspect.getsource(qos.reject)
    assert "self.restore_by_tag(delivery_tag, leftmost=True)" in reject
    # the one other reader of the hash, Channel._restore, is not used by the Redis QoS
    source = inspect.getsource(qos)
    assert "._restore(" not in source and "_restore_at_beginning" not in source


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


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"[]", "a JSON list"),
        (b"\xff not json", "not JSON"),
        (b"[" * 100_000, "nested deeper"),
        (b"x" * (3 * 1024 * 1024), "exceeds CLEANUP_MAX_MESSAGE_BYTES"),
        (b'{"body": "e30="}', "'properties'"),
    ],
)
def test_a_broadcast_that_is_not_an_envelope_is_dropped_by_the_redis_transport(
    data: bytes, words: str
) -> None:
    problem = redis_transport.screen_broadcast(data)
    assert problem is not None and words in problem


def test_kombu_passes_over_a_pub_sub_reply_whose_type_is_not_a_message() -> None:
    """cleanup.worker.redis_transport drops a broadcast by renaming its type in ``_handle_message``;
    kombu's ``_receive_one`` must still deliver only types ending in 'message'."""
    from kombu.transport import redis

    channel: Any = redis.Channel
    receive = inspect.getsource(channel._receive_one)
    assert "payload = self._handle_message(c, response)" in receive
    assert "if bytes_to_str(payload['type']).endswith('message'):" in receive


# --- remote control -----------------------------------------------------------------------

REPLY = "reply.celery.pidbox"
ALLOWED = frozenset({"ping", "stats"})


@pytest.mark.parametrize(
    ("body", "headers", "reason", "words"),
    [
        ([], {}, "malformed", "body is a list"),
        ({"method": "shutdown"}, {}, "not_allowed", "'shutdown' is not in"),
        ({"method": "pool_shrink", "arguments": {"n": 1}}, {}, "not_allowed", "pool_shrink"),
        ({"method": 1}, {}, "malformed", "'method'"),
        ({"method": "ping", "arguments": [1]}, {}, "malformed", "'arguments'"),
        ({"method": "ping", "destination": "w1"}, {}, "malformed", "'destination'"),
        ({"method": "ping", "pattern": "(a+)+$", "matcher": "pcre"}, {}, "malformed", "glob"),
        (
            {"method": "ping", "reply_to": {"exchange": "", "routing_key": "cleanup"}},
            {},
            "malformed",
            "'reply_to'",
        ),
        ({"method": "ping", "extra": 1}, {}, "malformed", "'extra'"),
        ({"method": "ping"}, {"clock": "x"}, "malformed", "'clock'"),
        # a clock every reply would then carry: thousands of digits broke their encoding
        ({"method": "ping"}, {"clock": 10**1000}, "malformed", "'clock' is out of range"),
        ({"method": "ping"}, {"clock": 2**63}, "malformed", "'clock' is out of range"),
    ],
)
def test_a_control_message_outside_the_allowed_commands_is_dropped(
    body: Any, headers: dict[str, Any], reason: str, words: str
) -> None:
    problem = remote_control.check_command(body, headers, ALLOWED, REPLY)
    assert problem is not None and problem[0] == reason and words in problem[1]


def test_the_commands_the_tools_send_pass() -> None:
    # what `celery inspect ping -d w1@host` and Flower's stats page send
    for body in (
        {
            "method": "ping",
            "arguments": {},
            "destination": ["w1@host"],
            "pattern": None,
            "matcher": None,
            "reply_to": {"exchange": REPLY, "routing_key": "5609b3fb"},
            "ticket": "a1",
        },
        {"method": "stats", "arguments": None, "destination": None},
    ):
        assert remote_control.check_command(body, {"clock": 7}, ALLOWED, REPLY) is None


def test_a_command_celery_does_not_have_fails_the_worker_start(settings: Any) -> None:
    settings.CLEANUP_REMOTE_CONTROL_COMMANDS = ["ping", "shutdwon"]
    with pytest.raises(ImproperlyConfigured, match="CLEANUP_REMOTE_CONTROL_COMMANDS.*shutdwon"):
        remote_control.allowed_commands()


def test_our_amqp_header_scan_still_matches_py_amqps_decoder() -> None:
    """cleanup.worker.amqp_transport scans content headers with its own table of py-amqp's field
    types and property layout, and hands py-amqp's frame handler a stand-in header for a refused
    delivery. When py-amqp changes its table decoder, its basic properties or where its frame
    handler decodes a header, this fails, and the scan (and tests/unit/test_amqp_transport.py)
    must be checked against the new version."""
    import re
    from struct import pack

    import amqp
    from amqp import method_framing
    from amqp import serialization as _serialization

    from cleanup.worker import amqp_transport

    serialization: Any = _serialization  # its type stubs lack the private decoder
    message: Any = amqp.Message

    # the same field types, each taking as many bytes as the scan skips
    letters = set(re.findall(r"ftype == '(.)'", inspect.getsource(serialization._read_item)))
    fixed = {chr(kind): size for kind, size in amqp_transport._FIXED_SIZE.items()}
    assert letters == set(fixed) | {"S", "x", "F", "A"}
    for letter, size in fixed.items():
        item = letter.encode() + bytes(16)
        assert serialization._read_item(item, 0)[1] == 1 + size, letter
    two_bytes = {"S": b"ab", "x": b"ab", "A": b"VV", "F": b"\x00V"}  # F: a nameless void
    for letter, content in two_bytes.items():
        item = letter.encode() + pack(">I", 2) + content
        assert serialization._read_item(item, 0)[1] == 7, letter
    # every basic property set: py-amqp reads exactly what the scan walks, not a byte more
    frame = pack(">HHQ", 60, 0, 0) + message(
        content_type="a", content_encoding="b", application_headers={"h": [1, {"x": None}]},
        delivery_mode=2, priority=1, correlation_id="c", reply_to="d", expiration="1",
        message_id="e", timestamp=1, type="f", user_id="g", app_id="h", cluster_id="i",
    )._serialize_properties()  # fmt: skip
    assert serialization.decode_properties_basic(frame, 12)[1] == len(frame)
    assert amqp_transport.check_content_header(frame) is None
    assert amqp_transport.check_content_header(frame[:-1]) == "content header is truncated"
    # the frame handler still decodes a header where the scan puts itself in front of it
    source = inspect.getsource(method_framing.frame_handler)
    assert "elif frame_type == 2:" in source and "msg.inbound_header(buf)" in source


# --- dead letters are always stored -------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "message",
    [
        {**GOOD, "reservation_id": 2**64},
        {**GOOD, "version": 2**40},
        {**GOOD, "trace_id": "\ud800"},
        {**GOOD, "trace_id": "a\x00b", "idempotency_key": "\x00" * 500},
        {**GOOD, "trace_id": "x" * (2 * 1024 * 1024)},
        {"deep": json.loads("[" * 500 + "]" * 500)},
    ],
    ids=["id 2**64", "version 2**40", "lone surrogate", "NUL bytes", "2 MB", "deep"],
)
def test_record_stores_a_bounded_row_for_any_message(message: dict) -> None:
    letter = dead_letters.record(
        DeadLetter.Reason.MALFORMED, error="bad \x00 \ud800", message=message, payload=message
    )
    assert letter is not None
    stored = DeadLetter.objects.get(pk=letter.pk)
    assert stored.reason == "malformed"
    assert len(stored.payload) <= dead_letters.PAYLOAD_LIMIT
    assert stored.message is None or len(json.dumps(stored.message)) <= dead_letters.MESSAGE_LIMIT
    assert stored.reservation_id in (None, 1) and stored.version in (None, 1)
    assert "\x00" not in stored.error + stored.payload + stored.trace_id


@pytest.mark.django_db
def test_record_never_raises_and_keeps_the_reason_when_the_row_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(dead_letters, "_storable_message", lambda m: {"bad": "\x00"})
    letter = dead_letters.record(DeadLetter.Reason.FAILED, error="boom", message=dict(GOOD))
    assert letter is not None
    assert DeadLetter.objects.get(pk=letter.pk).error.startswith("boom [row rejected")


# --- receipts never block a real release --------------------------------------------------


def _message(hold_id: int, version: int = 1) -> object:
    return validate(build(hold_id, version, timezone.now() - timedelta(minutes=1), 0, "t"))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["single", "batch"])
def test_a_message_for_a_hold_that_does_not_exist_yet_never_blocks_its_release(path) -> None:
    # given: a message naming the id the next hold will get, handled before the hold exists
    offering = services.create_offering("future", 2)
    first = services.hold_seat(offering.pk, "a", 60)
    future_id = first.pk + 1
    attempt = Attempt(1, "w@h", "task-1", 0.1)

    def handle() -> str:
        message = _message(future_id)
        if path == "single":
            return release(message, attempt)  # type: ignore[arg-type]
        return release_batch([message], attempt)[future_id]  # type: ignore[list-item]

    assert handle() == "not_found"
    # when: that hold is created, expires, and its release message comes
    later = services.hold_seat(offering.pk, "b", 60)
    assert later.pk == future_id
    expire(later.pk, due=False)
    # then: it is released, with exactly one 'released' receipt
    assert handle() == "released"
    assert Reservation.objects.get(pk=later.pk).status == "released"
    receipts = list(CleanupReceipt.objects.filter(reservation_id=future_id))
    assert [(r.idempotency_key, r.outcome) for r in receipts] == [
        (f"release:{future_id}:1", "released")
    ]
    offering.refresh_from_db()
    assert offering.seats_available == 1  # one seat back, one still held by the first hold
    assert handle() == "already_handled"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["single", "batch"])
def test_an_old_non_released_receipt_for_the_key_is_replaced_by_the_release(path) -> None:
    # given: a not_found receipt an older version wrote for a key whose hold now expired
    offering = services.create_offering("legacy", 1)
    hold = services.hold_seat(offering.pk, "a", 60)
    expire(hold.pk, due=False)
    CleanupReceipt.objects.create(
        idempotency_key=f"release:{hold.pk}:1",
        reservation_id=hold.pk,
        version=1,
        outcome="not_found",
    )
    attempt = Attempt(2, "w@h", "task-2", 0.1)
    # when
    if path == "single":
        outcome = release(_message(hold.pk), attempt)  # type: ignore[arg-type]
    else:
        outcome = release_batch([_message(hold.pk)], attempt)[hold.pk]  # type: ignore[list-item]
    # then
    assert outcome == "released"
    receipt = CleanupReceipt.objects.get(idempotency_key=f"release:{hold.pk}:1")
    assert (receipt.outcome, receipt.attempt, receipt.task_id) == ("released", 2, "task-2")
    assert Reservation.objects.get(pk=hold.pk).status == "released"


def test_the_green_pools_control_consumer_is_screened_too() -> None:
    """A green pool (gevent, eventlet) starts its control consumer in a greenlet of its own, after
    the bootstep's start: the screening must neither expect it at start (the worker crashed at
    start-up with AttributeError, seen with ``--pool gevent``) nor miss it when it is made."""
    from types import SimpleNamespace

    from kombu import Connection

    from config.celery_app import app

    spawned: list[Any] = []
    c = SimpleNamespace(
        app=app,
        hostname="w1@host",
        controller=SimpleNamespace(use_eventloop=False),
        pool=SimpleNamespace(spawn_n=lambda fn, *args: spawned.append(fn)),
    )
    box = remote_control.ScreenedGreenPidbox(c)
    box.start(c)  # hands its loop to the pool; no consumer yet
    assert spawned == [box.loop]
    with Connection("memory://") as connection:
        box._do_reset(c, connection)  # what the loop does first, in its greenlet
        assert box.consumer.on_decode_error == box.on_decode_error


def test_a_worker_pool_without_the_time_limits_fails_the_start_unless_allowed(
    settings: Any,
) -> None:
    """The consumer's check on the pool instance Celery hands it (the real pool classes; the
    worker itself: tests/integration/test_failure_paths_real.py)."""
    from celery.concurrency import prefork, solo, thread

    from cleanup.worker.consumer import refuse_unsafe_pool

    # object.__new__: the pool's class is what is checked; nothing is started
    threads, lone, processes = (object.__new__(m.TaskPool) for m in (thread, solo, prefork))
    refuse_unsafe_pool(processes)  # the default: prefork starts
    with pytest.raises(ImproperlyConfigured, match="--pool threads: the threads pool enforces no"):
        refuse_unsafe_pool(threads)
    with pytest.raises(
        ImproperlyConfigured, match=r"--pool solo: .*\(CLEANUP_WORKER_POOLS=prefork\)"
    ):
        refuse_unsafe_pool(lone)
    settings.CLEANUP_WORKER_POOLS = ["prefork", "threads"]
    refuse_unsafe_pool(threads)  # allowed, to measure it
