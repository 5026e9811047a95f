"""The RabbitMQ transport's screening of AMQP content headers, on frames written by hand: the
pre-scan of the header table (deep tables and arrays, truncated and garbage bytes, Celery's own
headers, linear time), and the frame handler around py-amqp's own (a refused delivery is
rejected, its body dropped and one dead letter written; the next delivery decodes; errors of
the delivery callback and of the frame stream still propagate)."""

from __future__ import annotations

import inspect
import os
import random
import time
import uuid
from struct import pack
from typing import Any

import amqp
import pytest
from amqp import spec
from amqp.exceptions import FrameSyntaxError, UnexpectedFrame
from amqp.serialization import dumps as _dumps
from kombu import Connection

from cleanup.models import DeadLetter
from cleanup.worker import amqp_transport
from cleanup.worker.amqp_transport import MAX_DEPTH, check_content_header
from config.celery_app import app
from tests.support.child_python import run_python

# py-amqp's type stubs lack the message's frame (de)serialization methods used here.
Message: Any = amqp.Message
dumps: Any = _dumps
HEADERS_FLAG, CONTENT_TYPE_FLAG = 0x2000, 0x8000


def chain(depth: int, kind: bytes) -> bytes:
    """A field value of ``depth`` tables (``b"F"``, each holding the next as item ``d``) or
    arrays (``b"A"``) inside each other, written out without recursion."""
    prefix = b"\x01d" if kind == b"F" else b""
    parts, size = [], 0
    for _ in range(depth):
        parts.append(kind + pack(">I", size))
        size += len(prefix) + 5
    return prefix.join(reversed(parts))


def table(items: bytes) -> bytes:
    return pack(">I", len(items)) + items


def header(headers: bytes | None, body_size: int = 0, content_type: bytes | None = None) -> bytes:
    """A content-header frame's payload: basic class, ``body_size``, these properties."""
    flags = (HEADERS_FLAG if headers is not None else 0) | (
        CONTENT_TYPE_FLAG if content_type else 0
    )
    out = pack(">HHQH", spec.Basic.CLASS_ID, 0, body_size, flags)
    if content_type is not None:
        out += bytes([len(content_type)]) + content_type
    return out + (headers or b"")


def celery_header(body: bytes = b"[]") -> bytes:
    """The content header py-amqp writes for a task message as Celery builds it."""

    task_id = str(uuid.uuid4())
    task = app.amqp.as_task_v2(
        task_id,
        "cleanup.release_reservation",
        args=({"reservation_id": 1},),
        time_limit=10,
        soft_time_limit=8,
    )
    message = Message(
        body,
        content_type="application/json",
        content_encoding="utf-8",
        application_headers=task.headers,
        delivery_mode=2,
        priority=0,
        **task.properties,
    )
    return pack(">HHQ", spec.Basic.CLASS_ID, 0, len(body)) + message._serialize_properties()


# --- the pre-scan -----------------------------------------------------------------------


def test_the_hand_written_tables_are_what_py_amqp_writes() -> None:
    nested: dict[str, Any] = {}
    for _ in range(4):
        nested = {"d": nested}
    assert table(b"\x04deep" + chain(5, b"F")) == dumps("F", [{"deep": nested}])
    assert table(b"\x01a" + chain(3, b"A")) == dumps("F", [{"a": [[[]]]}])


def test_celerys_own_header_table_passes() -> None:
    frame = celery_header()
    assert check_content_header(frame) is None
    # ... and py-amqp decodes what passed
    message = Message()
    message.inbound_header(frame)
    assert message.properties["application_headers"]["task"] == "cleanup.release_reservation"


@pytest.mark.parametrize("kind", [b"F", b"A"], ids=["tables", "arrays"])
def test_nesting_is_refused_above_the_cap_and_accepted_at_it(kind: bytes) -> None:
    # the header table itself is one level, so MAX_DEPTH - 1 containers inside it fill the cap
    at_cap = header(table(b"\x01x" + chain(MAX_DEPTH - 1, kind)))
    above = header(table(b"\x01x" + chain(MAX_DEPTH, kind)))
    deep = header(table(b"\x01x" + chain(3000, kind)))
    assert check_content_header(at_cap) is None
    assert check_content_header(above) == f"header table is nested deeper than {MAX_DEPTH} levels"
    assert check_content_header(deep) == f"header table is nested deeper than {MAX_DEPTH} levels"
    # py-amqp itself cannot decode the deep one
    with pytest.raises(RecursionError):
        Message().inbound_header(deep)


def test_every_truncation_of_a_header_is_refused_without_raising() -> None:
    frame = celery_header()
    for cut in range(len(frame)):
        problem = check_content_header(frame[:cut])
        assert problem is not None and "truncated" in problem, (cut, problem)


@pytest.mark.parametrize(
    ("frame", "words"),
    [
        (header(table(b"\x01kZ")), "unknown field type"),
        (header(table(b"\x01kS" + pack(">I", 2**31) + b"abc")), "truncated"),
        (header(table(b"\x01kF" + pack(">I", 100))), "truncated"),
        (header(table(b"\x01kA" + pack(">I", 3) + b"VVVV")), "truncated"),  # item overruns
        (header(table(b"\x50k")), "truncated"),  # a name longer than the table
        (header(pack(">I", 10**6) + b"\x01kV"), "truncated"),
        (pack(">HHQH", 10, 0, 0, 0), "class 10"),
        (b"\x00\x3c\x00", "truncated"),
    ],
    ids=[
        "unknown type",
        "string past the end",
        "table past the end",
        "array item overrunning",
        "name past the end",
        "length past the frame",
        "not basic class",
        "too short",
    ],
)
def test_garbage_is_refused(frame: bytes, words: str) -> None:
    problem = check_content_header(frame)
    assert problem is not None and words in problem


def test_random_bytes_never_make_the_scan_raise_and_what_passes_decodes_without_recursing() -> None:
    rng = random.Random(18)
    good = celery_header()
    for _ in range(3000):
        frame = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            frame[rng.randrange(14, len(frame))] = rng.choice(
                b"FAVSs\x00\xff" + bytes([rng.randrange(256)])
            )
        problem = check_content_header(bytes(frame))  # never raises
        if problem is None:
            try:
                Message().inbound_header(bytes(frame))
            except RecursionError:  # pragma: no cover - the failure this test looks for
                pytest.fail(f"passed the scan, yet recursed: {bytes(frame)!r}")
            except Exception:  # noqa: BLE001 - other decode errors are contained by the handler
                pass


def test_the_scan_takes_linear_time() -> None:
    """8x the input takes about 8x the time, quadratic would be ~64x (a ratio measured in one
    run, not a wall-clock limit): wide tables of blocks nested to the cap, scalars and strings
    between. Small and large are timed in turns, best of seven, so both see the same load."""
    block = chain(MAX_DEPTH - 2, b"A") + b"V" + b"t\x01" + b"S" + pack(">I", 3) + b"abc"

    def frame(blocks: int) -> bytes:
        array = b"A" + pack(">I", len(block) * blocks) + block * blocks
        return header(table(b"\x01a" + array))

    small, large = frame(1000), frame(8000)
    best = {len(small): float("inf"), len(large): float("inf")}
    for _ in range(7):
        for data in (small, large):
            start = time.perf_counter()
            assert check_content_header(data) is None
            best[len(data)] = min(best[len(data)], time.perf_counter() - start)
    ratio = best[len(large)] / best[len(small)]
    print(f"scan of {len(small)} bytes vs {len(large)} bytes: time ratio {ratio:.2f}")
    assert ratio < 24


# --- the frame handler around py-amqp's -------------------------------------------------


class FakeChannel:
    def __init__(self) -> None:
        self.rejected: list[tuple[int, bool]] = []

    def basic_reject(self, delivery_tag: int, requeue: bool) -> None:
        self.rejected.append((delivery_tag, requeue))


class FakeConnection:
    def __init__(self) -> None:
        self.bytes_recv = 0
        self.channels = {1: FakeChannel(), 2: FakeChannel()}


def deliver_frame(tag: int, routing_key: str = "cleanup") -> bytes:
    return pack(">HH", *spec.Basic.Deliver) + dumps("sLbss", ["ctag", tag, False, "", routing_key])


class Handler:
    """``screened_frame_handler`` over py-amqp's real frame handler, with what reached the
    delivery callback."""

    def __init__(self, fail: bool = False) -> None:
        self.connection = FakeConnection()
        self.delivered: list[tuple[int, Any, Any]] = []
        self.fail = fail
        self.on_frame = amqp_transport.screened_frame_handler(self.connection, self.callback)

    def callback(self, channel: int, method_sig: Any, args: Any, content: Any) -> None:
        if self.fail:
            raise RuntimeError("raised by the delivery callback")
        self.delivered.append((channel, method_sig, content))

    def send(self, channel: int, tag: int, head: bytes, body: bytes, chunk: int = 4) -> None:
        self.on_frame((1, channel, deliver_frame(tag)))
        self.on_frame((2, channel, head))
        for i in range(0, len(body), chunk):
            self.on_frame((3, channel, body[i : i + chunk]))


DEEP = table(b"\x04deep" + chain(3000, b"F"))
GOOD_HEADERS = dumps("F", [{"task": "cleanup.release_reservation", "timelimit": [10, 8]}])


@pytest.mark.django_db
def test_a_deep_delivery_is_rejected_once_its_body_dropped_and_the_next_one_decodes() -> None:
    handler = Handler()
    bad_body, good_body = b"x" * 10, b"[[], {}, {}]"
    # when: a deep delivery (body in three frames), then a good one on the same channel
    handler.send(1, 7, header(DEEP, len(bad_body)), bad_body)
    handler.send(1, 8, header(GOOD_HEADERS, len(good_body), b"application/json"), good_body)
    # then: only the good one reached the callback, decoded
    assert [(c, sig) for c, sig, _ in handler.delivered] == [(1, spec.Basic.Deliver)]
    content = handler.delivered[0][2]
    assert content.body == good_body
    assert content.properties["application_headers"]["timelimit"] == [10, 8]
    # ... the deep one was rejected without requeue, on its channel, by its tag
    assert handler.connection.channels[1].rejected == [(7, False)]
    # ... every frame was counted as traffic (heartbeats rely on it): method, header, 3 bodies
    assert handler.connection.bytes_recv == 2 * (1 + 1 + 3)
    # ... and one dead letter says why, where and which delivery
    (letter,) = DeadLetter.objects.all()
    assert letter.reason == "rejected"
    assert f"nested deeper than {MAX_DEPTH} levels" in letter.error
    assert "'cleanup'" in letter.error and "delivery tag 7" in letter.error
    assert '"routing_key": "cleanup"' in letter.payload and '"delivery_tag": 7' in letter.payload


@pytest.mark.django_db
def test_a_header_that_passes_the_scan_but_does_not_decode_is_contained() -> None:
    handler = Handler()
    # a content type that is not UTF-8: py-amqp's decoder raises UnicodeDecodeError
    handler.send(1, 3, header(GOOD_HEADERS, 4, b"\xff\xfe"), b"body")
    handler.send(1, 4, header(GOOD_HEADERS, 4), b"body")
    assert [content.body for _, _, content in handler.delivered] == [b"body"]
    assert handler.connection.channels[1].rejected == [(3, False)]
    (letter,) = DeadLetter.objects.all()
    assert "does not decode (UnicodeDecodeError" in letter.error


@pytest.mark.django_db
def test_a_bodyless_refused_delivery_and_interleaved_channels() -> None:
    handler = Handler()
    handler.on_frame((1, 1, deliver_frame(5)))
    handler.on_frame((1, 2, deliver_frame(6)))
    handler.on_frame((2, 1, header(DEEP, 6)))  # refused; 6 body bytes to drop on channel 1
    handler.on_frame((2, 2, header(GOOD_HEADERS, 2)))
    handler.on_frame((8, 0, b""))  # a heartbeat in between
    handler.on_frame((3, 1, b"abc"))
    handler.on_frame((3, 2, b"ok"))  # channel 2's body still reaches py-amqp
    handler.on_frame((3, 1, b"def"))
    handler.on_frame((1, 1, deliver_frame(9)))
    handler.on_frame((2, 1, header(DEEP, 0)))  # refused, no body
    handler.on_frame((1, 1, deliver_frame(10)))
    handler.on_frame((2, 1, header(GOOD_HEADERS, 0)))  # bodyless, delivered
    assert [(c, content.body) for c, _, content in handler.delivered] == [(2, b"ok"), (1, "")]
    assert handler.connection.channels[1].rejected == [(5, False), (9, False)]
    assert handler.connection.channels[2].rejected == []
    assert DeadLetter.objects.count() == 2


@pytest.mark.django_db
def test_a_refused_get_ok_answers_the_waiting_basic_get_with_get_empty() -> None:
    handler = Handler()
    get_ok = pack(">HH", *spec.Basic.GetOk) + dumps("Lbssl", [11, False, "", "cleanup", 0])
    handler.on_frame((1, 1, get_ok))
    handler.on_frame((2, 1, header(DEEP, 0)))
    assert [(c, sig) for c, sig, _ in handler.delivered] == [(1, spec.Basic.GetEmpty)]
    assert handler.connection.channels[1].rejected == [(11, False)]


def test_an_error_of_the_delivery_callback_still_propagates() -> None:
    handler = Handler(fail=True)
    handler.on_frame((1, 1, deliver_frame(1)))
    with pytest.raises(RuntimeError, match="delivery callback"):
        handler.on_frame((2, 1, header(GOOD_HEADERS, 0)))  # bodyless: delivered from the header
    assert handler.connection.channels[1].rejected == []


@pytest.mark.django_db
def test_a_broken_frame_stream_is_still_a_connection_error() -> None:
    handler = Handler()
    # a method frame where the refused delivery's body should be
    handler.on_frame((1, 1, deliver_frame(1)))
    handler.on_frame((2, 1, header(DEEP, 10)))
    with pytest.raises(UnexpectedFrame):
        handler.on_frame((1, 1, deliver_frame(2)))
    # a header where no delivery was announced: py-amqp's own error
    with pytest.raises(UnexpectedFrame):
        Handler().on_frame((2, 1, header(DEEP, 0)))
    # a header too short to say how large its body is
    other = Handler()
    other.on_frame((1, 1, deliver_frame(1)))
    with pytest.raises(FrameSyntaxError):
        other.on_frame((2, 1, b"\x00\x3c\x00"))


# --- selection --------------------------------------------------------------------------


def test_connections_of_both_transports_read_through_the_screened_handler() -> None:
    from kombu import Connection

    plain: Any = Connection(
        "amqp://guest:guest@127.0.0.1:5672/x", transport=amqp_transport.Transport
    )
    tls: Any = Connection("amqps://guest:guest@127.0.0.1/x", transport=amqp_transport.SSLTransport)
    assert plain.transport.Connection is amqp_transport.Connection
    assert tls.transport.Connection is amqp_transport.Connection
    assert tls.ssl and tls.transport.default_connection_params["port"] == 5671
    connection: Any = amqp_transport.Connection(host="127.0.0.1:1")  # not connected
    assert connection.frame_handler_cls is amqp_transport.screened_frame_handler


@pytest.mark.parametrize(
    ("url", "transport"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/x", "cleanup.worker.amqp_transport:Transport"),
        ("pyamqp://guest:guest@127.0.0.1:5672/x", "cleanup.worker.amqp_transport:Transport"),
        ("amqps://guest:guest@127.0.0.1:5671/x", "cleanup.worker.amqp_transport:SSLTransport"),
    ],
)
def test_the_settings_select_the_screened_transport_for_amqp_urls(url: str, transport: str) -> None:
    env = {**os.environ, "CELERY_BROKER_URL": url, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    out = run_python(
        "from config.settings import test; print(test.CELERY_BROKER_TRANSPORT)", env, check=True
    )
    assert out.stdout.strip() == transport


# --- py-amqp's own decoder, and a cluster's failover ------------------------------------------


def test_our_amqp_header_scan_still_matches_py_amqps_decoder() -> None:
    """cleanup.worker.amqp_transport scans content headers with its own table of py-amqp's field
    types and property layout, and hands py-amqp's frame handler a stand-in header for a refused
    delivery. When py-amqp changes its table decoder, its basic properties or where its frame
    handler decodes a header, this fails, and the scan (and the tests above)
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


@pytest.mark.parametrize(
    ("url", "transport"),
    [
        ("amqp://guest:guest@127.0.0.1:1//;amqp://guest:guest@127.0.0.1:2//", "Transport"),
        ("amqps://guest:guest@127.0.0.1:1//;amqps://guest:guest@127.0.0.1:2//", "SSLTransport"),
    ],
)
def test_a_failed_connection_switching_to_the_next_node_keeps_the_screened_transport(
    url: str, transport: str
) -> None:
    # given: a broker connection over two nodes, as Celery makes it from the settings
    conn = Connection(url, transport=f"cleanup.worker.amqp_transport:{transport}")
    # when: kombu switches to the next URL, as it does after a failed connection attempt
    conn.maybe_switch_next()
    # then: the URL's scheme selects the project's transport, not kombu's unscreened one
    assert conn.port == 2
    assert type(conn.transport) is getattr(amqp_transport, transport)
