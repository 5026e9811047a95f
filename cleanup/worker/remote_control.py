"""The workers' remote-control channel, screened.

Celery's remote control (the "pidbox") is a broadcast that every worker's main process
consumes: anyone who can write to the broker can send a command, and Celery runs any command
it knows (``shutdown``, ``pool_shrink``, ``cancel_consumer``, ``revoke``…), replies to any
exchange the message names, and resets its consumer on every malformed body. This worker
consumer step runs only the commands in ``CLEANUP_REMOTE_CONTROL_COMMANDS`` (by default the
read-only ones that ``manage.py worker_health``, ``celery inspect`` and Flower's pages use) on
bodies of the shape kombu's ``Mailbox`` sends, and drops everything else with a log line and
``reservation_cleanup_control_messages_dropped_total{reason}``. A dropped control message is
not a dead letter: it names no hold and asks a person for nothing.

Garbage that is not even a broker envelope never gets here on Redis: the screened transport
drops it (``cleanup.worker.redis_transport``). Docs: docs/HARDENING.md, "Remote control".
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from celery.worker import control, pidbox
from celery.worker.consumer.control import Control
from django.core.exceptions import ImproperlyConfigured

from cleanup import metrics
from cleanup.conf import cleanup_settings

logger = logging.getLogger("cleanup.remote_control")

# The keys kombu's Mailbox._broadcast writes into a control message.
_BODY_KEYS = frozenset(
    {"method", "arguments", "destination", "pattern", "matcher", "reply_to", "ticket"}
)
# 'pcre' would compile a sender's regular expression in the main process (a slow one stalls
# every consumer of this worker); glob and exact destinations are what the tools use.
_MATCHERS = (None, "glob")
# A Lamport clock counts messages. kombu adopts max(own, clock) + 1 and every later message adds
# one, and each reply carries the clock in an AMQP header, a signed 64-bit integer at most: a
# clock of 2**63 - 1 left the next reply unencodable, and every reply after it, until a restart.
# 2**53 - 1 (also the largest integer a JSON reader with doubles keeps exact) leaves room for
# 2**63 - 2**53 more messages.
MAX_CLOCK = 2**53 - 1
# The headers kombu's Mailbox writes on a control message (``expires`` is read only by the
# sender's reply collector).
_HEADERS = frozenset({"clock", "expires"})
# What a reply echoes: ``reply_to``'s routing key becomes the reply's routing key (an AMQP
# short string, 255 bytes at most) and ``ticket`` a header of the reply (the whole header must
# fit one frame). kombu's own are UUIDs (36 characters).
MAX_NAME_BYTES = 255
# Names a message may list or match (destination, pattern): more than any fleet has, a bound on
# the work one message costs.
MAX_DESTINATIONS = 1000
# A command's arguments, encoded: the read-only commands take a few ids at most.
MAX_ARGUMENTS_BYTES = 64 * 1024


def _short_text(value: Any) -> bool:
    return isinstance(value, str) and len(value.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES


def allowed_commands() -> frozenset[str]:
    """The configured commands, each one Celery knows (a typo fails the worker's start)."""
    names = frozenset(cleanup_settings().remote_control_commands)
    unknown = sorted(names - set(control.Panel.data))
    if unknown:
        raise ImproperlyConfigured(
            f"CLEANUP_REMOTE_CONTROL_COMMANDS names {', '.join(unknown)}, which Celery's "
            f"remote control does not have"
        )
    return names


def check_command(
    body: Any, headers: Any, allowed: frozenset[str], reply_exchange: str
) -> tuple[str, str] | None:
    """(reason, problem) when a control message must be dropped, else None."""
    if not isinstance(body, dict):
        return "malformed", f"body is a {type(body).__name__}, not an object"
    extra = sorted(str(key) for key in body if key not in _BODY_KEYS)
    if extra:
        return "malformed", f"body has the key {extra[0][:80]!r}"
    method = body.get("method")
    if not isinstance(method, str):
        return "malformed", "'method' is not a string"
    if method not in allowed:
        return "not_allowed", f"command {method[:80]!r} is not in CLEANUP_REMOTE_CONTROL_COMMANDS"
    arguments = body.get("arguments")
    if arguments is not None and not (
        isinstance(arguments, dict) and all(isinstance(k, str) for k in arguments)
    ):
        return "malformed", "'arguments' is not an object"
    if arguments and len(_encoded(arguments)) > MAX_ARGUMENTS_BYTES:
        return "malformed", f"'arguments' are larger than {MAX_ARGUMENTS_BYTES} bytes"
    destination = body.get("destination")
    if destination is not None and not (
        isinstance(destination, list | tuple)
        and len(destination) <= MAX_DESTINATIONS
        and all(_short_text(d) for d in destination)
    ):
        return "malformed", (
            f"'destination' is not a list of at most {MAX_DESTINATIONS} names of at most "
            f"{MAX_NAME_BYTES} bytes"
        )
    if body.get("matcher") not in _MATCHERS or not (
        body.get("pattern") is None or _short_text(body.get("pattern"))
    ):
        return "malformed", f"only glob patterns of at most {MAX_NAME_BYTES} bytes are matched"
    reply_to = body.get("reply_to")
    if reply_to is not None and not (
        isinstance(reply_to, dict)
        and reply_to.get("exchange") == reply_exchange
        and isinstance(reply_to.get("routing_key"), str)
    ):
        return "malformed", f"'reply_to' names an exchange other than {reply_exchange!r}"
    if reply_to is not None and not _short_text(reply_to["routing_key"]):
        return "malformed", f"'reply_to' routing key is longer than {MAX_NAME_BYTES} bytes"
    ticket = body.get("ticket")
    if ticket is not None and not _short_text(ticket):
        return "malformed", f"'ticket' is not a string of at most {MAX_NAME_BYTES} bytes"
    return _check_headers(headers)


def _encoded(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # a value JSON cannot hold (AMQP's decimals, bytes)
        return repr(value)


def _check_headers(headers: Any) -> tuple[str, str] | None:
    """The headers kombu's Mailbox writes, bounded so that every reply the worker sends after
    this message can still be encoded."""
    if headers is None:
        return None
    if not isinstance(headers, dict):
        return "malformed", "headers are not a table"
    extra = sorted(str(key) for key in headers if key not in _HEADERS)
    if extra:
        return "malformed", f"header {extra[0][:80]!r} is not one kombu's mailbox sets"
    clock = headers.get("clock")
    if clock is not None and (isinstance(clock, bool) or not isinstance(clock, int)):
        return "malformed", "header 'clock' is not an integer"
    if clock is not None and not 0 <= clock <= MAX_CLOCK:
        # kombu's Lamport clock adopts max(own, clock) + 1 and every later reply carries it.
        return "malformed", f"header 'clock' is out of range (0…{MAX_CLOCK})"
    expires = headers.get("expires")
    if expires is not None and not (
        isinstance(expires, int | float)
        and not isinstance(expires, bool)
        and math.isfinite(expires)
        and 0 <= expires <= MAX_CLOCK
    ):
        return "malformed", "header 'expires' is not a time"
    return None


def record_drop(reason: str, problem: str) -> None:
    logger.warning("control message dropped", extra={"reason": reason, "error": problem})
    metrics.record_control_drop(reason)


class _Screened:
    """Mixed into Celery's Pidbox (and its green-pool variant)."""

    def __init__(self, c: Any) -> None:
        super().__init__(c)  # type: ignore[call-arg]
        self.allowed = allowed_commands()
        self.reply_exchange = c.app.control.mailbox.reply_exchange.name

    def start(self, c: Any) -> None:
        super().start(c)  # type: ignore[misc]
        self._screen_decode_errors()

    def _screen_decode_errors(self) -> None:
        # Celery hands the task consumer's decode-error handler to the pidbox consumer too,
        # which would dead-letter a control message as if it were a task. The green pool's
        # pidbox has no consumer yet when it starts: it makes one in its own greenlet.
        consumer = getattr(self, "consumer", None)
        if consumer is not None:
            consumer.on_decode_error = self.on_decode_error

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        record_drop("undecodable", repr(exc)[:500])

    def on_message(self, body: Any, message: Any) -> None:
        problem = check_command(
            body, getattr(message, "headers", None), self.allowed, self.reply_exchange
        )
        if problem is not None:
            record_drop(*problem)
            return
        super().on_message(body, message)  # type: ignore[misc]


class ScreenedPidbox(_Screened, pidbox.Pidbox):
    pass


class ScreenedGreenPidbox(_Screened, pidbox.gPidbox):
    def _do_reset(self, c: Any, connection: Any) -> None:
        # Where the green pidbox makes (and remakes, after a reset) its consumer.
        super()._do_reset(c, connection)  # type: ignore[misc]
        self._screen_decode_errors()


# celery-types does not declare the bootstep's attributes.
_Control: Any = Control


class ScreenedControl(_Control):
    """Celery's remote-control bootstep with the screened pidbox in place of its own."""

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.box = (ScreenedGreenPidbox if self.is_green else ScreenedPidbox)(c)
        self.start = self.box.start
        self.stop = self.box.stop
        self.shutdown = self.box.shutdown
