"""kombu's py-amqp transport, with every content header screened before py-amqp decodes it.

An AMQP delivery is a method frame, a content-header frame (the message's properties, its
``application_headers`` table among them) and body frames. py-amqp decodes the header table
recursively, inside the connection's frame handler, before kombu or Celery see a message: a
table nested a few thousand levels deep raises ``RecursionError`` there, the worker's main
process stops, and the unacknowledged message goes to the next worker, which stops too.

This transport's connections read frames through ``screened_frame_handler``, which wraps
py-amqp's own frame handler (nothing of py-amqp is copied). Each content-header frame is first
walked by ``check_content_header``: an iterative scan, linear in the frame's size, that follows
the property list to the header table and refuses one nested deeper than ``MAX_DEPTH`` or whose
lengths and field types do not add up. A refused delivery, or one whose header py-amqp still
cannot decode, is handed to py-amqp as an empty stand-in header (so its frame state moves on as
for a bodyless message) and never reaches kombu; its body frames are read and dropped; it is
rejected without requeue on its channel, logged, and recorded as one ``rejected`` dead letter
with the exchange, routing key, delivery tag and the reason. The connection reads on. Only
connection-level errors (frames out of order, a header too short to say how large its body is,
a failing socket) propagate, as they do with py-amqp's own handler.

Selected by the ``broker_transport`` setting for ``amqp://``/``pyamqp://`` (``Transport``) and
``amqps://`` (``SSLTransport``) broker URLs, and by those schemes' aliases once this module is
loaded, so a failover to the next URL of a cluster's list keeps it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from struct import pack, unpack_from
from typing import Any

from amqp import spec
from amqp.exceptions import FrameSyntaxError, UnexpectedFrame
from amqp.method_framing import frame_handler
from amqp.serialization import dumps, loads
from kombu.transport import TRANSPORT_ALIASES, pyamqp

from cleanup import metrics
from cleanup.broker.screening import MAX_NESTING, max_bytes

logger = logging.getLogger("cleanup.amqp_transport")

# Tables and arrays inside the header table, the table itself counted: the same cap as the JSON
# nesting of a message body. Celery's own headers nest 2 deep (``timelimit``, ``stamps``).
MAX_DEPTH = MAX_NESTING

# Field values py-amqp's table decoder reads (amqp.serialization._read_item): a type octet, then
# a fixed number of bytes, a 4-byte length and that many bytes, or a nested table/array.
_FIXED_SIZE = {
    ord("b"): 1,
    ord("B"): 1,
    ord("t"): 1,
    ord("s"): 2,
    ord("U"): 2,
    ord("u"): 2,
    ord("I"): 4,
    ord("i"): 4,
    ord("f"): 4,
    ord("D"): 5,
    ord("L"): 8,
    ord("l"): 8,
    ord("d"): 8,
    ord("T"): 8,
    ord("V"): 0,
}
_LONG_STRING = frozenset({ord("S"), ord("x")})
_TABLE, _ARRAY = ord("F"), ord("A")

# The basic class's properties in the order they follow the flags (amqp.spec / py-amqp's
# decode_properties_basic): a short string, the header table, or a fixed number of bytes.
_SHORT_STRING, _HEADER_TABLE = "shortstr", "table"
_PROPERTIES: tuple[tuple[int, str | int], ...] = (
    (0x8000, _SHORT_STRING),  # content_type
    (0x4000, _SHORT_STRING),  # content_encoding
    (0x2000, _HEADER_TABLE),  # application_headers
    (0x1000, 1),  # delivery_mode
    (0x0800, 1),  # priority
    (0x0400, _SHORT_STRING),  # correlation_id
    (0x0200, _SHORT_STRING),  # reply_to
    (0x0100, _SHORT_STRING),  # expiration
    (0x0080, _SHORT_STRING),  # message_id
    (0x0040, 8),  # timestamp
    (0x0020, _SHORT_STRING),  # type
    (0x0010, _SHORT_STRING),  # user_id
    (0x0008, _SHORT_STRING),  # app_id
    (0x0004, _SHORT_STRING),  # cluster_id
)

# The methods that carry content, and the layout of their arguments (amqp.spec).
_CONTENT_METHODS = {
    spec.Basic.Deliver: "sLbss",  # consumer_tag, delivery_tag, redelivered, exchange, routing_key
    spec.Basic.GetOk: "Lbssl",  # delivery_tag, redelivered, exchange, routing_key, message_count
    spec.Basic.Return: "Bsss",  # reply_code, reply_text, exchange, routing_key
}

# What py-amqp is given instead of a refused header: basic class, no body, no properties.
STAND_IN_HEADER = pack(">HHQH", spec.Basic.CLASS_ID, 0, 0, 0)

# What a basic.get waiting for a refused get-ok is answered instead: the queue looked empty.
GET_EMPTY_METHOD = pack(">HH", *spec.Basic.GetEmpty) + dumps("s", ("",))

# Set on an exception that came out of the delivery callback (kombu, Celery), so it is never
# mistaken for a header that failed to decode.
_FROM_CALLBACK = "_cleanup_from_delivery_callback"

Buffer = bytes | bytearray | memoryview


def check_table(buf: Buffer, offset: int = 0, max_depth: int = MAX_DEPTH) -> str | None:
    """Why the AMQP field table at ``offset`` (its 4-byte length first) must not be decoded, or
    ``None``. Iterative: every step moves forward through the bytes and only the ends of the
    open tables and arrays are kept (at most ``max_depth``), so time is linear in the table's
    size and memory bounded, whatever the nesting."""
    size = len(buf)
    if offset + 4 > size:
        return "header table is truncated"
    (length,) = unpack_from(">I", buf, offset)
    offset += 4
    if offset + length > size:
        return "header table is truncated"
    open_ends = [offset + length]  # where each open table/array ends, innermost last
    keyed = [True]  # whether its items have names (a table) or not (an array)
    while open_ends:
        end = open_ends[-1]
        if offset == end:
            open_ends.pop()
            keyed.pop()
            continue
        if keyed[-1]:
            offset += 1 + buf[offset]  # the name: a length octet and that many bytes
        if offset >= end:
            return "header table is truncated"
        kind = buf[offset]
        offset += 1
        fixed = _FIXED_SIZE.get(kind)
        if fixed is not None:
            offset += fixed
        elif kind in _LONG_STRING or kind == _TABLE or kind == _ARRAY:
            if offset + 4 > end:
                return "header table is truncated"
            (length,) = unpack_from(">I", buf, offset)
            offset += 4
            if kind in _LONG_STRING:
                offset += length
            elif offset + length > end:
                return "header table is truncated"
            elif len(open_ends) >= max_depth:
                return f"header table is nested deeper than {max_depth} levels"
            else:
                open_ends.append(offset + length)
                keyed.append(kind == _TABLE)
                continue
        else:
            return f"header table has an unknown field type {kind!r} at byte {offset - 1}"
        if offset > end:
            return "header table is truncated"
    return None


def check_content_header(buf: Buffer, max_depth: int = MAX_DEPTH) -> str | None:
    """Why a content-header frame's payload must not be decoded, or ``None``: it is not of the
    basic class, a property runs past its end, or its header table fails ``check_table``. What
    the properties say (text that is not UTF-8, say) is left to py-amqp's decoder, whose errors
    the frame handler contains."""
    size = len(buf)
    if size < 14:
        return "content header is truncated"
    (class_id,) = unpack_from(">H", buf, 0)
    if class_id != spec.Basic.CLASS_ID:
        return f"content header of class {class_id}, not basic"
    (body_size,) = unpack_from(">Q", buf, 4)
    if body_size > max_bytes():
        # Refused from the header's word, before py-amqp buffers a body frame: RabbitMQ
        # accepts bodies up to 128 MiB, and py-amqp keeps the whole body before handing it on.
        return f"body of {body_size} bytes exceeds CLEANUP_MAX_MESSAGE_BYTES ({max_bytes()} bytes)"
    (flags,) = unpack_from(">H", buf, 12)
    offset = 14
    for flag, kind in _PROPERTIES:
        if not flags & flag:
            continue
        if kind == _HEADER_TABLE:
            problem = check_table(buf, offset, max_depth)
            if problem is not None:
                return problem
            (length,) = unpack_from(">I", buf, offset)
            offset += 4 + length
        elif kind == _SHORT_STRING:
            if offset >= size:
                return "content header is truncated"
            offset += 1 + buf[offset]
        else:
            offset += int(kind)
        if offset > size:
            return "content header is truncated"
    return None


def _delivery(method_frame: Buffer | None) -> dict[str, Any]:
    """What the content method says about the delivery (its tag, where it was sent)."""
    if method_frame is None:
        return {}
    try:
        method_sig = unpack_from(">HH", method_frame, 0)
        values, _ = loads(_CONTENT_METHODS[method_sig], method_frame, 4)
    except Exception:  # noqa: BLE001 - py-amqp itself accepted this frame; describe what we can
        return {}
    names: tuple[str, ...]
    if method_sig == spec.Basic.Deliver:
        names = ("consumer_tag", "delivery_tag", "redelivered", "exchange", "routing_key")
    elif method_sig == spec.Basic.GetOk:
        names = ("delivery_tag", "redelivered", "exchange", "routing_key", "message_count")
    else:
        names = ("reply_code", "reply_text", "exchange", "routing_key")
    return {"method": "basic." + _METHOD_NAMES[method_sig], **dict(zip(names, values, strict=True))}


_METHOD_NAMES = {
    spec.Basic.Deliver: "deliver",
    spec.Basic.GetOk: "get-ok",
    spec.Basic.Return: "return",
}


# Celery's remote-control exchanges (``celery.pidbox`` and its reply exchange).
PIDBOX_SUFFIX = ".pidbox"


def refuse_delivery(
    connection: Any, channel_id: int, method_frame: Buffer | None, header: Buffer, problem: str
) -> None:
    """Reject the delivery without requeue (a returned message has nothing to reject), log it
    and record one dead letter. Only a connection-level error of the reject propagates."""
    info = _delivery(method_frame)
    delivery_tag = info.get("delivery_tag")
    channel = (connection.channels or {}).get(channel_id)
    if delivery_tag is not None and channel is not None:
        channel.basic_reject(delivery_tag, requeue=False)
    if str(info.get("exchange", "")).endswith(PIDBOX_SUFFIX):
        # A remote-control message names no hold: counted as a dropped broadcast, as on Redis.
        logger.warning("AMQP control message dropped", extra={"error": problem[:300]})
        metrics.record_control_drop("malformed")
        return
    details = {
        "channel": channel_id,
        "queue": info.get("routing_key", ""),
        "delivery_tag": delivery_tag,
        "error": problem,
    }
    logger.error("AMQP delivery refused before decoding", extra=details)
    try:
        dead_letter_delivery(info, channel_id, header, problem)
    except Exception:
        logger.exception("could not dead-letter an AMQP delivery", extra=details)


def dead_letter_delivery(
    info: dict[str, Any], channel_id: int, header: Buffer, problem: str
) -> None:
    from cleanup.models import DeadLetter  # noqa: PLC0415 - kombu may load this transport before Django's app registry is ready
    from cleanup.release import dead_letters  # noqa: PLC0415 - kombu may load this transport before Django's app registry is ready

    where = info.get("routing_key", "?")
    dead_letters.record(
        DeadLetter.Reason.REJECTED,
        error=(
            f"AMQP delivery refused before decoding: {problem} "
            f"(routing key {where!r}, delivery tag {info.get('delivery_tag')})"
        ),
        payload={
            **info,
            "channel": channel_id,
            "header_bytes": len(header),
            "header": bytes(header[:2048]),
        },
    )


def screened_frame_handler(
    connection: Any,
    callback: Callable[..., Any],
    max_depth: int = MAX_DEPTH,
    inner_handler: Callable[..., Callable[[Any], Any]] = frame_handler,
) -> Callable[[tuple[int, int, Any]], Any]:
    """py-amqp's frame handler (``inner_handler``), with each content header screened first.

    A delivery whose header fails ``check_content_header``, or whose decoding raises anything
    outside the delivery callback, is refused (``refuse_delivery``): py-amqp is given
    ``STAND_IN_HEADER`` in its place, which completes that message with no body, and the message
    this produces is dropped instead of being passed on (a basic.get gets get-empty); the body
    frames that follow on that channel are counted off and dropped. Everything else goes to
    py-amqp unchanged.
    """
    pending_methods: dict[int, Buffer] = {}  # channel -> content method awaiting its header
    discarding: dict[int, int] = {}  # channel -> body bytes of a refused delivery still to come
    refusing: set[int] = set()  # channels whose stand-in message must not be delivered

    def deliver(channel: int, method_sig: Any, args: Any, content: Any) -> Any:
        if channel in refusing:
            if method_sig == spec.Basic.GetOk:
                # basic.get waits for get-ok or get-empty: release it as if the queue were empty
                return callback(channel, spec.Basic.GetEmpty, GET_EMPTY_METHOD, None)
            return None
        try:
            return callback(channel, method_sig, args, content)
        except BaseException as exc:
            try:
                setattr(exc, _FROM_CALLBACK, True)
            except Exception:  # noqa: BLE001 - an exception without attributes: only loses the mark
                pass
            raise

    inner = inner_handler(connection, deliver)

    def on_header(frame: tuple[int, int, Any]) -> Any:
        _, channel, buf = frame
        method_frame = pending_methods.pop(channel, None)
        try:
            problem = check_content_header(buf, max_depth)
        except Exception as exc:  # noqa: BLE001 - a bug in the scan must not stop the worker
            problem = f"content header could not be screened ({type(exc).__name__})"
        if method_frame is None:
            # No delivery announced on this channel: py-amqp raises its connection-level error.
            return inner(frame)
        if problem is None:
            try:
                return inner(frame)
            except Exception as exc:
                if getattr(exc, _FROM_CALLBACK, False):
                    raise
                problem = f"content header does not decode ({type(exc).__name__}: {str(exc)[:200]})"
        if len(buf) < 12:
            raise FrameSyntaxError("content header frame too short to give its body size")
        (body_size,) = unpack_from(">Q", buf, 4)
        refusing.add(channel)
        try:
            inner((2, channel, STAND_IN_HEADER))
        finally:
            refusing.discard(channel)
        if body_size:
            discarding[channel] = body_size
        refuse_delivery(connection, channel, method_frame, buf, problem)
        return False

    def on_frame(frame: tuple[int, int, Any]) -> Any:
        frame_type, channel, buf = frame
        left = discarding.get(channel)
        if left is not None and frame_type != 8:
            if frame_type != 3:
                raise UnexpectedFrame(
                    f"Received frame {frame_type} while expecting type: 3 (a refused body)"
                )
            connection.bytes_recv += 1
            left -= len(buf)
            if left > 0:
                discarding[channel] = left
            else:
                del discarding[channel]
            return False
        if frame_type == 2:
            return on_header(frame)
        result = inner(frame)
        if frame_type == 1 and unpack_from(">HH", buf, 0) in _CONTENT_METHODS:
            pending_methods[channel] = buf
        return result

    return on_frame


class Connection(pyamqp.Connection):
    """py-amqp's connection as kombu uses it, reading frames through ``screened_frame_handler``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["frame_handler"] = screened_frame_handler
        super().__init__(*args, **kwargs)


class Transport(pyamqp.Transport):
    Connection = Connection


class SSLTransport(pyamqp.SSLTransport):
    Connection = Connection


# A RabbitMQ cluster's URL lists every node (``amqp://a;amqp://b;amqp://c``). kombu keeps each
# entry as a failover alternate, and when a connection attempt fails it switches to the next by
# parsing that URL, which sets the transport to the URL's scheme whatever the
# ``broker_transport`` setting names: the worker would reconnect, after losing a node, on
# kombu's own unscreened py-amqp transport. The schemes' aliases name these transports instead
# (``librabbitmq`` too: kombu swaps ``amqp`` for it whenever that library is installed). The
# first broker connection of a process loads this module (``broker_transport``), so the aliases
# are in place before any switch can happen.
for _scheme in ("amqp", "pyamqp", "librabbitmq"):
    TRANSPORT_ALIASES[_scheme] = f"{__name__}:Transport"
TRANSPORT_ALIASES["amqps"] = f"{__name__}:SSLTransport"
