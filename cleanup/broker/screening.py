"""Bounds every broker message must meet before anything decodes it deeply or hands it on.

A worker's main process decodes a message, builds a request and hands it to a pool child.
Several of those steps raise *outside* any task when the message is hostile (an over-deep JSON
document, a garbage ``timelimit`` header, a body that is not ``[args, kwargs, embed]``), and an
exception there stops the whole worker; the message then comes back and stops the next one. The
consumer (``cleanup.worker.consumer``) and the Redis transport
(``cleanup.worker.redis_transport``) call these checks first; each returns ``None`` for a message
that may go on, or the reason it may not, which becomes the dead letter's error text. Docs:
docs/HARDENING.md.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from array import array
from datetime import UTC, datetime
from itertools import accumulate
from typing import Any

from kombu import compression, serialization
from kombu.exceptions import ContentDisallowed
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from cleanup.broker import routes
from cleanup.conf import cleanup_settings

# Release messages nest 3 levels ([args, kwargs, embed] → message), batches 5. Well below
# what json and pickle recurse through (~1,000 levels raise RecursionError).
MAX_NESTING = 32

# A JSON string: a quote, then runs of plain bytes or escape pairs, then the closing quote or
# the end of the text (an unterminated string). Possessive quantifiers and the end-of-text
# alternative make each string match run once to its close: a pattern that could fail on an
# unterminated string was retried from every later quote, quadratic on '"' + '\\"' * n
# (a 32 KB body cost seconds, a 1 MiB one most of an hour).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
# bytes.translate tables: delete every byte but brackets, then map an opening bracket to +1
# and a closing one to -1 (0xFF read as a signed byte).
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")


def _refuse_compressed(body: bytes) -> bytes:
    raise ContentDisallowed(
        "compressed bodies are refused: the project's publisher never compresses, and a few "
        "hundred bytes can decompress to gigabytes"
    )


def _refuse_trusted_content(body: Any) -> Any:
    raise ContentDisallowed(
        "only application/json is decoded: kombu decodes a body typed application/data or "
        "application/text by its content-encoding with Python's codecs, and bz2 and zlib are "
        "codecs"
    )


# The content types kombu accepts whatever the accept list says (kombu.serialization's
# TRUSTED_CONTENT); a body without a content type is read as the first.
TRUSTED_CONTENT_TYPES = ("application/data", "application/text")


def refuse_untrusted_decoding() -> None:
    """Make kombu refuse, in this process, every body it would decompress or decode by codec.

    Compressed bodies: see ``refuse_compressed_bodies``. Trusted content types: kombu's
    ``loads`` accepts ``application/data`` and ``application/text`` (and a body with no content
    type) whatever the accept list says, and decodes them with ``codecs.decode(body,
    content_encoding)``: 211 bytes with ``content-encoding: bz2`` grew a worker by 500 MiB.
    With a decoder registered for each (kombu's public ``register``, decoder only), kombu calls
    it instead of the codec and records the refusal as a decode error. The project only sends
    JSON; nothing legitimate is refused.
    """
    refuse_compressed_bodies()
    for content_type in TRUSTED_CONTENT_TYPES:
        serialization.register(
            f"refused:{content_type}", None, _refuse_trusted_content, content_type, "binary"
        )


# What the project's publishers (Celery's send_task, kombu's Mailbox, the outbox relay) put in
# a message's content type and encoding; anything else never reaches a decoder.
CONTENT_TYPE = "application/json"
CONTENT_ENCODING = "utf-8"


def check_content(content_type: Any, content_encoding: Any) -> str | None:
    """Only JSON in UTF-8 is decoded (a task or a control message, either broker)."""
    if content_type != CONTENT_TYPE:
        return f"content type {_preview(content_type)} is not {CONTENT_TYPE!r}"
    if content_encoding is not None and str(content_encoding).lower() != CONTENT_ENCODING:
        return f"content encoding {_preview(content_encoding)} is not {CONTENT_ENCODING!r}"
    return None


def refuse_compressed_bodies() -> None:
    """Make kombu refuse every compressed body in this process, before it is decompressed.

    kombu's ``Message`` decompresses a body by its ``compression`` header as it is built,
    before a transport or consumer check runs. With every decoder replaced, building the
    message records the refusal instead, and the consumer's decode-error path dead-letters
    it (a task message) or drops it (a control message). An unknown compression name fails
    the same way (kombu has no decoder for it). Encoders are kept.
    """
    registry: Any = compression  # its stubs type get_encoder as returning the encoder alone
    for content_type in registry.encoders():
        encoder, _ = registry.get_encoder(content_type)
        registry.register(encoder, _refuse_compressed, content_type)


def max_bytes() -> int:
    return cleanup_settings().max_message_bytes


def _as_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    return bytes(data)


def nesting_depth(data: bytes | str, limit: int = MAX_NESTING) -> int:
    """Deepest bracket nesting of a JSON text, strings skipped, in time linear in its length.

    Cheap on the common path: a document with fewer brackets than the limit cannot be deeper.
    Otherwise one regex pass blanks the strings and the running depth is summed in C
    (``array`` + ``accumulate``), never a Python loop per byte.
    """
    raw = _as_bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS).translate(_STEPS)
    return max(0, max(accumulate(array("b", brackets)), default=0))


def check_raw(data: bytes | str, what: str = "message body", slack: float = 1.0) -> str | None:
    """Size and nesting of raw bytes, before they are decoded. ``slack`` scales the size cap
    for an envelope that carries the body base64-encoded (4/3 of it) plus headers."""
    size = len(data)
    limit = int(max_bytes() * slack)
    if size > limit:
        return f"{what} of {size} bytes exceeds CLEANUP_MAX_MESSAGE_BYTES ({limit} bytes)"
    if nesting_depth(data) > MAX_NESTING:
        return f"{what} is nested deeper than {MAX_NESTING} levels"
    return None


def _number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _time(value: Any) -> bool:
    if isinstance(value, str):
        try:
            datetime.fromisoformat(value)
        except ValueError:
            return False
        return True
    return isinstance(value, datetime)


def _optional_text(value: Any) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= 1024)


def _optional_repr(value: Any) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= 2048)


def _optional_name(value: Any) -> bool:
    # django-celery-beat's PeriodicTask.name holds 200 characters.
    return value is None or (isinstance(value, str) and len(value) <= 200)


# The task headers Celery's request reads in the worker's main process, and what each must be.
_HEADER_CHECKS: dict[str, tuple[Any, str]] = {
    "id": (lambda v: isinstance(v, str) and 0 < len(v) <= 255, "a task id string"),
    "root_id": (_optional_text, "a string or null"),
    "parent_id": (_optional_text, "a string or null"),
    "group": (_optional_text, "a string or null"),
    "shadow": (_optional_text, "a string or null"),
    "origin": (_optional_text, "a string or null"),
    "lang": (_optional_text, "a string or null"),
    # Celery cuts both at 1,024 characters (argsrepr_maxsize) and adds an ellipsis.
    "argsrepr": (_optional_repr, "a string of at most 2048 characters, or null"),
    "kwargsrepr": (_optional_repr, "a string of at most 2048 characters, or null"),
    "periodic_task_name": (_optional_name, "a string of at most 200 characters, or null"),
    "redelivered": (lambda v: v is None or isinstance(v, bool), "a boolean or null"),
    "timelimit": (
        lambda v: (
            v is None
            or (
                isinstance(v, list | tuple)
                and len(v) == 2
                and all(x is None or _number(x) for x in v)
            )
        ),
        "[hard, soft] seconds (numbers or null)",
    ),
    "eta": (lambda v: v is None or _time(v), "an ISO 8601 time or null"),
    "expires": (lambda v: v is None or _time(v), "an ISO 8601 time or null"),
    "retries": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31,
        "a non-negative integer",
    ),
    "ignore_result": (lambda v: v is None or isinstance(v, bool), "a boolean or null"),
    "group_index": (
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
        "an integer or null",
    ),
    "replaced_task_nesting": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1000,
        "a small integer",
    ),
    "stamped_headers": (
        lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
        "a list of strings or null",
    ),
    "stamps": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "enqueued_at": (lambda v: v is None or _number(v), "a Unix time or null"),
    # cleanup.broker.signing: verified by the consumer once the body is decoded
    "cleanup_signature": (
        lambda v: v is None or (isinstance(v, str) and len(v) <= 128),
        "a signature string or null",
    ),
}


def check_headers(headers: dict[str, Any]) -> str | None:
    """Every header Celery reads has the type it expects (``task`` is checked by the caller)."""
    for name, (ok, expected) in _HEADER_CHECKS.items():
        if name in headers and not ok(headers[name]):
            return f"header {name!r} must be {expected}, got {_preview(headers[name])}"
    if "id" not in headers:
        return "header 'id' is missing"
    return None


def check_payload(payload: Any) -> str | None:
    """A decoded task body must be ``[args, kwargs, embed]``: a list, an object, an object or
    null (Celery unpacks it without looking)."""
    if not isinstance(payload, list | tuple) or len(payload) != 3:
        return f"task body must be [args, kwargs, embed], got {_preview(payload)}"
    args, kwargs, embed = payload
    if not isinstance(args, list | tuple):
        return f"task body's args must be a list, got {type(args).__name__}"
    if not isinstance(kwargs, dict):
        return f"task body's kwargs must be an object, got {type(kwargs).__name__}"
    if embed is not None and not isinstance(embed, dict):
        return f"task body's embed must be an object or null, got {type(embed).__name__}"
    return None


# The W3C Trace Context headers (https://www.w3.org/TR/trace-context/) a traced publisher adds
# (cleanup.tracing): admitted only in their exact syntax. traceparent is version 00's
# "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>" (55 characters), ids not all zeros;
# tracestate is at most 32 comma-separated key=value list members in 512 characters.
TRACE_HEADERS = ("traceparent", "tracestate")
TRACEPARENT_LENGTH = 55
TRACESTATE_MAX_CHARS = 512
TRACESTATE_MAX_MEMBERS = 32
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)


def trace_header_problem(name: str, value: Any) -> str | None:
    """Why a ``traceparent`` or ``tracestate`` header is malformed, or ``None``."""
    if not isinstance(value, str):
        return f"{name} is not a string"
    if name == "traceparent":
        if len(value) != TRACEPARENT_LENGTH or not _TRACEPARENT.fullmatch(value):
            return "traceparent is not 00-<trace id>-<parent id>-<flags>"
        return None
    if len(value) > TRACESTATE_MAX_CHARS:
        return f"tracestate is longer than {TRACESTATE_MAX_CHARS} characters"
    members = [member.strip(" \t") for member in value.split(",")]
    if len(members) > TRACESTATE_MAX_MEMBERS:
        return f"tracestate has more than {TRACESTATE_MAX_MEMBERS} list members"
    if not all(member == "" or _TRACESTATE_MEMBER.fullmatch(member) for member in members):
        return "tracestate has a member that is not key=value"
    return None


def drop_malformed_trace_headers(headers: dict[str, Any]) -> list[str]:
    """Remove a malformed ``traceparent`` or ``tracestate`` from a task message's headers (in
    place, before Celery builds the request from them); the names removed. A trace header is
    context, never trusted: a bad one costs the trace, not the message. A tracestate without
    a valid traceparent goes too (it means nothing alone)."""
    dropped = [
        name
        for name in TRACE_HEADERS
        if name in headers and trace_header_problem(name, headers[name]) is not None
    ]
    for name in dropped:
        del headers[name]
    if "tracestate" in headers and "traceparent" not in headers:
        del headers["tracestate"]
        dropped.append("tracestate")
    return dropped


# What the project's own publishers write on a task message: Celery's send_task and retry (the
# sweep's fan-out, beat's sends, the dead-letter requeue), django-celery-beat's entry name, and
# kombu's redelivery flag on a restored Redis message, and the W3C trace headers (checked and
# dropped when malformed by ``drop_malformed_trace_headers``, first). A header outside this set
# is a request the project never makes (docs/HARDENING.md, "Only what the publisher asks for").
PUBLISHER_HEADERS = frozenset(
    {
        *_HEADER_CHECKS,
        *TRACE_HEADERS,
        "task",
        "redelivered",
        "periodic_task_name",
        "celery_beat_task",
    }
)
# Headers the publisher always leaves empty: groups, chords, replacement and stamping are
# Celery features the pipeline never uses.
_EMPTY_HEADERS = ("group", "group_index", "shadow", "stamped_headers", "stamps")
# The body's embedded options: links (callbacks, errbacks, a chain, a chord) would make a
# worker publish further tasks the project never asked for.
_EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})
# Clock skew allowed between the publisher that stamped a time and this worker.
CLOCK_SKEW_SECONDS = 5.0


def _aware(value: Any) -> datetime:
    when = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def check_publish_options(
    headers: dict[str, Any],
    embed: Any,
    *,
    time_limits: tuple[float | None, float | None],
    eta_bound_seconds: float,
    now: datetime,
    broker_headers: frozenset[str] = frozenset(),
) -> str | None:
    """A task message may ask for nothing the project's own publisher would not ask for.

    Run after ``check_headers`` (types already checked) on a message for a project task:
    only ``PUBLISHER_HEADERS``; no group, chord, stamping or replacement; no links in the
    body; an ``eta`` at most ``eta_bound_seconds`` ahead (the longest retry countdown: a
    later one is held in memory and, on Redis, redelivered to a second worker once the
    visibility timeout passes); ``timelimit`` no higher than the worker's own
    ``time_limits`` (hard, soft); an ``expires`` no earlier than the publish stamp (the
    publisher never sends a message that is already expired). ``broker_headers`` are the
    headers the broker itself adds (a quorum queue's delivery count: ``cleanup.broker.queues``).
    """
    unknown = sorted(
        name for name in headers if name not in PUBLISHER_HEADERS and name not in broker_headers
    )
    if unknown:
        return f"header {_preview(unknown[0])} is not one the project's publisher sets"
    for name in _EMPTY_HEADERS:
        if headers.get(name):
            return f"header {name!r} asks for a Celery feature the project never uses"
    if headers.get("replaced_task_nesting"):
        return "header 'replaced_task_nesting' asks for task replacement"
    if isinstance(embed, dict):
        extra = sorted(str(key) for key in embed if key not in _EMBED_KEYS)
        if extra:
            return f"task body's embed has {_preview(extra[0])}, which the publisher never sets"
        linked = sorted(key for key in _EMBED_KEYS if embed.get(key))
        if linked:
            return f"task body links further tasks ({linked[0]}); the publisher never does"
    if headers.get("eta") is not None:
        if not headers.get("retries"):
            # Only a retry is scheduled (Task.retry, autoretry's backoff); a first delivery
            # with an eta would be held in the worker's memory until then.
            return "eta on a first delivery: the publisher schedules only retries"
        ahead = (_aware(headers["eta"]) - now).total_seconds()
        if ahead > eta_bound_seconds + CLOCK_SKEW_SECONDS:
            return (
                f"eta is {ahead:.0f} s ahead; the publisher schedules at most "
                f"{eta_bound_seconds:.0f} s ahead (CLEANUP_RETRY_BACKOFF_MAX)"
            )
    limit = headers.get("timelimit")
    if limit is not None:
        for asked, allowed, which in zip(limit, time_limits, ("hard", "soft"), strict=True):
            if asked is not None and allowed is not None and asked > allowed:
                return (
                    f"timelimit asks for a {which} limit of {asked} s, above the "
                    f"worker's {allowed} s"
                )
    if headers.get("expires") is not None and _number(headers.get("enqueued_at")):
        expires = _aware(headers["expires"]).timestamp()
        if expires < headers["enqueued_at"] - CLOCK_SKEW_SECONDS:
            return "expires is earlier than the message's publish time (enqueued_at)"
    return None


# What a release message may weigh: its envelope fields, then each hold it carries (an item is
# ~150 bytes of JSON; a batch's holds share the envelope). Other tasks carry a few small values.
BASE_BODY_BYTES = 4096
BODY_BYTES_PER_HOLD = 512


def holds_carried(payload: Any) -> int:
    """The holds a decoded ``[args, kwargs, embed]`` body names: a batch's items, one for a
    one-hold release, none for any other task (sweeps, relay, prune)."""
    args, kwargs = payload[0], payload[1]
    message = args[0] if args else kwargs.get("message")
    if not isinstance(message, dict):
        return 0
    items = message.get("items")
    return len(items) if isinstance(items, list) else 1


def check_body_size(size: int, payload: Any) -> str | None:
    """A body no larger than what the holds it carries need (run after ``check_payload``).
    The general cap (``CLEANUP_MAX_MESSAGE_BYTES``) bounds one message; this bounds each one
    to its purpose, so a worker holding many (eta retries, prefetched ones) stays small."""
    holds = holds_carried(payload)
    limit = BASE_BODY_BYTES + BODY_BYTES_PER_HOLD * holds
    if size > limit:
        return (
            f"body of {size} bytes is larger than a message carrying {holds} hold(s) needs "
            f"({limit} bytes)"
        )
    return None


def check_envelope(payload: Any, *, content: bool = False) -> str | None:
    """A Redis list entry decoded from JSON must be a kombu envelope that kombu can turn into
    a message and bookkeep as unacked: body, headers, properties with a delivery tag and
    delivery info, and a body its ``body_encoding`` can decode. With ``content``, also JSON in
    UTF-8 (``check_content``): for broadcasts, which kombu decodes before any project code; a
    task message's content is checked by the consumer, after its task name."""
    if not isinstance(payload, dict):
        return f"not a broker envelope: a JSON {type(payload).__name__}"
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        return "not a broker envelope: 'properties' is missing or not an object"
    if not isinstance(properties.get("delivery_tag"), str):
        return "not a broker envelope: 'properties.delivery_tag' is not a string"
    info = properties.get("delivery_info")
    if not isinstance(info, dict) or not all(
        isinstance(info.get(k), str) for k in ("exchange", "routing_key")
    ):
        return "not a broker envelope: 'properties.delivery_info' lacks exchange/routing_key"
    headers = payload.get("headers")
    if headers is not None and not isinstance(headers, dict):
        return "not a broker envelope: 'headers' is not an object"
    for key in ("content-type", "content-encoding"):
        if payload.get(key) is not None and not isinstance(payload.get(key), str):
            return f"not a broker envelope: {key!r} is not a string"
    body = payload.get("body")
    if body is not None and not isinstance(body, str):
        return "not a broker envelope: 'body' is not a string"
    encoding = properties.get("body_encoding")
    if encoding not in (None, "base64"):
        return f"not a broker envelope: unsupported body_encoding {_preview(encoding)}"
    if body and encoding == "base64":
        try:
            base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            return "not a broker envelope: 'body' is not valid base64"
    if content:
        problem = check_content(payload.get("content-type"), payload.get("content-encoding"))
        if problem is not None:
            return f"not a broker envelope: {problem}"
    return None


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


# --- Redis entries (kombu's list entries and its ``unacked`` hash) ------------------------------

# An envelope carries the body base64-encoded (4/3 of its size) plus headers and properties.
ENVELOPE_SLACK = 1.5
# An unacked entry is ``[envelope, exchange, routing_key]``: the envelope plus two names.
UNACKED_SLACK = ENVELOPE_SLACK + 0.01


UnackedEntry = tuple[dict[str, Any], str, str]


def parse_unacked(raw: bytes | str) -> tuple[UnackedEntry | None, str | None]:
    """An entry of kombu's ``unacked`` hash as ``(envelope, exchange, routing_key)``, or
    ``(None, problem)``. Size and nesting are checked before anything is decoded, and the
    envelope must pass the same check as a list entry (kombu would restore it to a list)."""
    problem = check_raw(raw, "unacked entry", slack=UNACKED_SLACK)
    if problem is not None:
        return None, problem
    try:
        value = loads(bytes_to_str(raw))
    except Exception as exc:  # noqa: BLE001 - whatever the decoder raises, the entry is bad
        return None, f"unacked entry is not JSON ({type(exc).__name__}: {str(exc)[:200]})"
    if not isinstance(value, list) or len(value) != 3:
        return None, "unacked entry is not [message, exchange, routing_key]"
    message, exchange, routing_key = value
    if not isinstance(exchange, str) or not isinstance(routing_key, str):
        return None, "unacked entry's exchange and routing key are not strings"
    if not exchange and not routing_key:
        return None, "unacked entry names no exchange and no routing key"
    problem = routes.route_problem(exchange, routing_key)
    if problem is not None and not routes.is_events_route(exchange, routing_key):
        # kombu restores an entry to wherever it names: another key would receive a list. An
        # event a consumer of the events queue held goes back to that queue.
        return None, f"unacked entry is routed elsewhere: {problem}"
    problem = check_envelope(message)
    if problem is not None:
        return None, "unacked entry: " + problem.removeprefix("not a broker envelope: ")
    return (message, exchange, routing_key), None
