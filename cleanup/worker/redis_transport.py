"""kombu's Redis transport, with every list entry screened before kombu decodes it.

A Redis queue is a list of JSON envelopes that kombu writes and reads. Anything that can write
to Redis can push an entry that is not JSON, is JSON nested deep enough to exhaust the
recursion limit, or is JSON without the envelope's fields; kombu then raises inside its event
loop, before Celery sees a message, and the worker stops. The entry has already been popped, so
nothing would even keep it. This transport screens each popped entry (``cleanup.broker.screening``);
one that fails becomes a dead letter with the raw entry (bounded) and the reason, and the
worker reads on. Selected by the ``broker_transport`` setting when the broker is Redis.

``Channel._brpop_read`` below is kombu 5.7's own, with the screening between the pop and the
delivery; a unit test fails when kombu's version of it changes (tests/unit/test_hardening.py).

The ``unacked`` hash (kombu's ack emulation) is broker state too: ``ScreenedQoS`` screens each
entry before it is restored, so one planted entry cannot stop the restore of dead workers'
messages (docs/HARDENING.md, "Planted broker state").
"""

from __future__ import annotations

import logging
from queue import Empty
from typing import Any

from kombu.transport import redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from cleanup.broker import screening
from cleanup.broker.screening import ENVELOPE_SLACK, parse_unacked
from cleanup.telemetry import metrics

logger = logging.getLogger("cleanup.redis_transport")

# kombu's type stubs lack the Redis channel's private helpers this module calls.
_RedisChannel: Any = redis.Channel
_RedisTransport: Any = redis.Transport
_RedisQoS: Any = redis.QoS


def dead_letter_entry(item: bytes | str, queue: str, problem: str) -> None:
    from cleanup.models import DeadLetter  # noqa: PLC0415 - kombu may load this transport before Django's app registry is ready
    from cleanup.pipeline import deadletters  # noqa: PLC0415 - kombu may load this transport before Django's app registry is ready

    raw = item if isinstance(item, bytes) else item.encode("utf-8", "surrogatepass")
    logger.error("broker entry set aside", extra={"queue": queue, "error": problem})
    deadletters.record(
        DeadLetter.Reason.REJECTED,
        error=f"not a broker envelope: {problem}",
        payload={"queue": queue, "entry_bytes": len(raw), "entry": raw[:8192]},
    )


def screen_entry(item: bytes | str, queue: str) -> dict[str, Any] | None:
    """The decoded envelope, or ``None`` once a bad entry has been dead-lettered."""
    problem = screening.check_raw(item, "broker entry", slack=ENVELOPE_SLACK)
    payload: Any = None
    if problem is None:
        try:
            payload = loads(bytes_to_str(item))
        except Exception as exc:  # noqa: BLE001 - whatever the decoder raises, set it aside
            problem = f"not JSON ({type(exc).__name__}: {str(exc)[:200]})"
    if problem is None:
        problem = screening.check_envelope(payload)
        if problem is not None:
            problem = problem.removeprefix("not a broker envelope: ")
    if problem is None:
        return payload  # type: ignore[no-any-return]
    try:
        dead_letter_entry(item, queue, problem)
    except Exception:
        logger.exception("could not dead-letter a broker entry")
    return None


def screen_broadcast(data: bytes | str) -> str | None:
    """Why a pub/sub payload must be dropped, or ``None`` for a kombu envelope.

    Broadcasts (remote control, and events when a worker consumes them) arrive on Redis
    pub/sub, where kombu decodes the payload and builds a message with no guard: one
    ``PUBLISH`` of ``[]`` raised in every subscribed worker at once and stopped them all.
    """
    problem = screening.check_raw(data, "broadcast", slack=ENVELOPE_SLACK)
    if problem is not None:
        return problem
    try:
        payload = loads(bytes_to_str(data))
    except Exception as exc:  # noqa: BLE001 - whatever the decoder raises, drop the payload
        return f"not JSON ({type(exc).__name__})"
    return screening.check_envelope(payload)


def set_aside_unacked(raw: bytes | str, where: str, problem: str) -> None:
    """One bad unacked entry, already removed from the hash and its index: counted and kept as
    one dead letter (never raises)."""
    metrics.record_skipped_entry("unacked_restore")
    try:
        dead_letter_entry(raw, where, problem)
    except Exception:
        logger.exception("could not dead-letter an unacked entry")


class ScreenedQoS(_RedisQoS):
    """kombu's Redis ack emulation, with each ``unacked`` entry screened before it is restored.

    kombu's ``restore_by_tag`` decodes an entry and unpacks it as ``[message, exchange,
    routing_key]`` without looking; an entry that is not that raises, and ``restore_visible``
    (which restores dead workers' messages, newest first) stops at it on every scan, so the
    messages stranded before it are never restored. Here a bad entry is removed from
    ``unacked`` and ``unacked_index`` in the same transaction, counted and dead-lettered, and
    the scan goes on. ``restore_by_tag`` is kombu 5.7's own with the screening in place of the
    bare decode; tests/unit/test_hardening.py fails when kombu's version changes. Every path
    that restores an unacked entry goes through it: the visibility-timeout scan, a requeue,
    and the restore at shutdown.
    """

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        refused: list[tuple[bytes | str, str]] = []

        def restore_transaction(pipe: Any) -> None:
            refused.clear()  # the transaction runs again when the hash changed meanwhile
            p = pipe.hget(self.unacked_key, tag)
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            if p:
                entry, problem = parse_unacked(p)
                if entry is None:
                    refused.append((p, problem or "unreadable"))
                    return
                M, EX, RK = entry
                self.channel._do_restore_message(M, EX, RK, pipe, leftmost)

        with self.channel.conn_or_acquire(client) as client:
            client.transaction(restore_transaction, self.unacked_key)
        for raw, problem in refused:
            set_aside_unacked(raw, str(self.unacked_key), problem)


class Channel(_RedisChannel):
    QoS = ScreenedQoS

    def _handle_message(self, client: Any, r: Any) -> dict[str, Any]:
        """kombu's parsed pub/sub reply; a message whose payload is not a kombu envelope is
        renamed ``dropped``, which kombu's ``_receive_one`` passes over."""
        payload: dict[str, Any] = super()._handle_message(client, r)
        if bytes_to_str(payload["type"]).endswith("message") and payload["data"]:
            problem = screen_broadcast(payload["data"])
            if problem is not None:
                channel = bytes_to_str(payload["channel"])[:200]
                logger.warning(
                    "broadcast dropped", extra={"channel": channel, "error": problem[:300]}
                )
                metrics.record_control_drop("not_an_envelope")
                payload["type"] = "dropped"
        return payload

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # if there's a ConnectionError, disconnect so the next
                # iteration will reconnect automatically.
                self.client.connection.disconnect()
                raise
            if dest__item:
                dest, item = dest__item
                dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
                self._queue_cycle.rotate(dest)
                payload = screen_entry(item, dest)
                if payload is not None:
                    self.connection._deliver(payload, dest)
                return True
            else:
                raise Empty()
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                item = client.rpop(self._q_for_pri(queue, pri))
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    payload = screen_entry(item, queue)
                    if payload is None:
                        raise Empty()  # set aside; the next poll reads on
                    return payload
            self._maybe_update_queues_expire(client, queue)
            raise Empty()


class Transport(_RedisTransport):
    Channel = Channel
