"""kombu's Redis transport, with every list entry screened before kombu decodes it.

A Redis queue is a list of JSON envelopes that kombu writes and reads. Anything that can write
to Redis can push an entry that is not JSON, is JSON nested deep enough to exhaust the
recursion limit, or is JSON without the envelope's fields; kombu then raises inside its event
loop, before Celery sees a message, and the worker stops. The entry has already been popped, so
nothing would even keep it. This transport screens each popped entry (``cleanup.broker.screening``);
one that fails becomes a dead letter with the raw entry (bounded) and the reason, and the
worker reads on. Selected by the ``broker_transport`` setting when the broker is Redis.

``Channel._brpop_read`` below is kombu 5.7's own, with the screening between the pop and the
delivery; a unit test fails when kombu's version of it changes
(tests/unit/cleanup/broker/test_screening.py).

The ``unacked`` hash (kombu's ack emulation) is broker state too: ``ScreenedQoS`` screens each
entry before it is restored, so one planted entry cannot stop the restore of dead workers'
messages (docs/HARDENING.md, "Planted broker state").
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from queue import Empty
from typing import Any, TypeVar

import redis as redis_py
from kombu import exceptions as kombu_exceptions
from kombu.transport import TRANSPORT_ALIASES, redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from cleanup import metrics
from cleanup.broker import keys, routes, screening
from cleanup.broker.keys import HASH, LIST, SET, ZSET, is_wrong_type
from cleanup.broker.screening import ENVELOPE_SLACK, parse_unacked

logger = logging.getLogger("cleanup.redis_transport")

# kombu's type stubs lack the Redis channel's private helpers this module calls.
_RedisChannel: Any = redis.Channel
_RedisTransport: Any = redis.Transport
_RedisQoS: Any = redis.QoS
_kombu_redis: Any = redis
_PublishBatch: Any = _kombu_redis.PublishBatch
# kombu 5.7's error for a pipelined publish that failed (not in kombu's type stubs).
BatchPublishError: Any = getattr(kombu_exceptions, "BatchPublishError")  # noqa: B009

T = TypeVar("T")

# How often one operation sets a key aside and tries again before giving up: a key planted
# again at once, over and over, is an attack in progress, not a stray value.
QUARANTINE_ATTEMPTS = 3


class KeyKeptWrong(redis_py.ConnectionError):
    """A key was quarantined and replaced with the wrong type again on every attempt. Raised as a
    connection error so that kombu and Celery reconnect (and the broker redelivers what was not
    acknowledged) instead of the worker exiting."""


def retry_after_quarantine(
    operation: Callable[[], T], quarantine: Callable[[], list[str]], where: str
) -> T:
    """Run ``operation``; when Redis answers WRONGTYPE, quarantine the offending keys and run it
    again (at most ``QUARANTINE_ATTEMPTS`` times in all)."""
    for _ in range(QUARANTINE_ATTEMPTS - 1):
        try:
            return operation()
        except redis_py.ResponseError as exc:
            if not is_wrong_type(exc):
                raise
            quarantine()
    try:
        return operation()
    except redis_py.ResponseError as exc:
        if not is_wrong_type(exc):
            raise
        raise KeyKeptWrong(
            f"{where}: a key stays of the wrong type after being quarantined"
        ) from exc


def dead_letter_entry(item: bytes | str, queue: str, error: str, reason: str = "rejected") -> None:
    from cleanup.models import DeadLetter  # noqa: PLC0415 - kombu may load this transport before Django's app registry is ready
    from cleanup.release import dead_letters  # noqa: PLC0415 - kombu may load this transport before Django's app registry is ready

    raw = item if isinstance(item, bytes) else item.encode("utf-8", "surrogatepass")
    logger.error("broker entry dead-lettered", extra={"queue": queue, "error": error})
    dead_letters.record(
        DeadLetter.Reason(reason),
        error=error,
        payload={"queue": queue, "entry_bytes": len(raw), "entry": raw[:8192]},
    )


def screen_entry(item: bytes | str, queue: str) -> dict[str, Any] | None:
    """The decoded envelope, or ``None`` once a bad entry has been dead-lettered.

    An entry of one of the project's task queues must also say it was routed there: kombu
    restores an unacknowledged message, and Celery routes its retry, by the delivery info the
    entry carries, so one naming another key would be pushed there later."""
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
    error = None if problem is None else f"not a broker envelope: {problem}"
    if error is None and queue in routes.task_queues():
        info = payload["properties"]["delivery_info"]
        if info["routing_key"] != queue:
            error = (
                f"misrouted: its delivery info names {info['routing_key'][:80]!r}, not {queue!r}"
            )
        elif (problem := routes.route_problem(info["exchange"], info["routing_key"])) is not None:
            error = f"misrouted: {problem}"
    if error is None:
        return payload  # type: ignore[no-any-return]
    reason = "misrouted" if error.startswith("misrouted: ") else "rejected"
    try:
        dead_letter_entry(item, queue, error, reason)
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
    return screening.check_envelope(payload, content=True)


def dead_letter_unacked(raw: bytes | str, where: str, problem: str) -> None:
    """One bad unacked entry, already removed from the hash and its index: counted and kept as
    one dead letter (never raises)."""
    metrics.record_skipped_entry("unacked_restore")
    try:
        dead_letter_entry(raw, where, f"not a broker envelope: {problem}")
    except Exception:
        logger.exception("could not dead-letter an unacked entry")


class ScreenedQoS(_RedisQoS):
    """kombu's Redis ack emulation, screened: each ``unacked`` entry before it is restored, and
    every key it touches for its type.

    kombu's ``restore_by_tag`` decodes an entry and unpacks it as ``[message, exchange,
    routing_key]`` without looking; an entry that is not that raises, and ``restore_visible``
    (which restores dead workers' messages, newest first) stops at it on every scan, so the
    messages stranded before it are never restored. Here a bad entry is removed from
    ``unacked`` and ``unacked_index`` in the same transaction, counted and dead-lettered, and
    the scan goes on. ``restore_by_tag`` is kombu 5.7's own with the screening in place of the
    bare decode; tests/unit/cleanup/broker/test_screening.py fails when kombu's version changes.
    Every path that restores an unacked entry goes through it: the visibility-timeout scan, a
    requeue, and the restore at shutdown.

    A key of the wrong type where the bookkeeping lives (``unacked``, ``unacked_index``, the
    queue a message is restored to) is quarantined (``cleanup.broker.keys``) and the operation
    runs again, so a delivery is still recorded and an ack still lands. The scan's lock is a
    PostgreSQL advisory lock, not kombu's ``unacked_mutex`` key (``restore_visible``).
    """

    _vrestore_count: int

    def _ack_keys(self) -> dict[str, str]:
        return {self.unacked_key: HASH, self.unacked_index_key: ZSET}

    def _quarantine_ack_keys(self) -> list[str]:
        with self.channel.conn_or_acquire() as client:
            return keys.quarantine(client, self._ack_keys(), "ack bookkeeping")

    def append(self, message: Any, delivery_tag: Any) -> None:
        retry_after_quarantine(
            lambda: super(ScreenedQoS, self).append(message, delivery_tag),
            self._quarantine_ack_keys,
            "recording a delivery",
        )

    def ack(self, delivery_tag: Any) -> None:
        retry_after_quarantine(
            lambda: super(ScreenedQoS, self).ack(delivery_tag),
            self._quarantine_ack_keys,
            "acknowledging a delivery",
        )

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        retry_after_quarantine(
            lambda: super(ScreenedQoS, self).reject(delivery_tag, requeue=requeue),
            self._quarantine_ack_keys,
            "rejecting a delivery",
        )

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu 5.7's scan for messages past the visibility timeout (run every
        ``interval``-th call), under the fleet's restore lease in PostgreSQL in place of kombu's
        lock in Redis (``unacked_mutex``), which anyone who can write to Redis can hold: planted
        again before each expiry, it kept crashed workers' messages stranded for as long as the
        writer liked. The Redis key is no longer read. A scan that meets a key of the wrong type
        quarantines it and runs again."""
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        held = _take_restore_lease()
        if held is False:
            return  # another worker is scanning now
        try:
            try:
                self._scan_visible(start, num)
            except redis_py.ResponseError as exc:
                if not is_wrong_type(exc):
                    raise
                self._quarantine_ack_keys()
                retry_after_quarantine(
                    lambda: self._scan_visible(start, num),
                    self._quarantine_ack_keys,
                    "restoring messages",
                )
        finally:
            if held:
                _end_restore_lease()

    def _scan_visible(self, start: int, num: int) -> None:
        with self.channel.conn_or_acquire() as client:
            # kombu's own clock (``kombu.transport.redis.time``), as its scan reads it.
            ceil = redis.time() - self.visibility_timeout  # type: ignore[attr-defined]
            visible = client.zrange(
                self.unacked_index_key,
                ceil,
                0,
                desc=True,
                byscore=True,
                offset=num and start,
                num=num,
                withscores=True,
            )
            for tag, _score in visible or []:
                self.restore_by_tag(tag, client)

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        refused: list[tuple[bytes | str, str]] = []
        counted = False

        def restore_transaction(pipe: Any) -> None:
            nonlocal counted
            refused.clear()  # the transaction runs again when the hash changed meanwhile
            p = pipe.hget(self.unacked_key, tag)
            entry, problem = parse_unacked(p) if p else (None, None)
            if entry is not None:
                # The push runs inside MULTI after the entry is removed from the hash: a
                # destination key of the wrong type would fail only the push and lose the
                # message, so such a key is quarantined before the transaction starts.
                self.channel.quarantine_restore_targets(entry[1], entry[2])
                # The redelivery is counted here, where it is made, and before the message is
                # back in its queue: counted after the push, another worker could pop it and
                # read the count without it, and run a poison message once past the cap. (If
                # the transaction then finds the entry gone, restored by another worker, the
                # count is one too high: the cap acts a delivery early, never late.)
                if not counted:
                    _count_redelivery(entry[0])
                    counted = True
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            if p:
                if entry is None:
                    refused.append((p, problem or "unreadable"))
                    return
                M, EX, RK = entry
                self.channel._do_restore_message(M, EX, RK, pipe, leftmost)

        def restore() -> None:
            with self.channel.conn_or_acquire(client) as conn:
                conn.transaction(restore_transaction, self.unacked_key)

        retry_after_quarantine(restore, self._quarantine_ack_keys, "restoring a message")
        for raw, problem in refused:
            dead_letter_unacked(raw, str(self.unacked_key), problem)


# How long a scan may hold the restore lease. A lease, not a session lock: a worker cut off from
# the broker but not from the database stalls inside its scan, and a lock held by its live
# session kept every other worker from restoring the messages it had stranded. Two scans at once
# are harmless (each restore is one Redis transaction on its entry); the lease only spares the
# fleet the duplicate work, and a stalled holder delays the others by at most this long.
RESTORE_LEASE_SECONDS = 10
_HOLDER = f"{socket.gethostname()[:150]}:{os.getpid()}"


def _holder() -> str:
    global _HOLDER
    if not _HOLDER.endswith(f":{os.getpid()}"):  # a forked child is a holder of its own
        _HOLDER = f"{socket.gethostname()[:150]}:{os.getpid()}"
    return _HOLDER


def _take_restore_lease() -> bool | None:
    """Take the fleet's restore lease (``cleanup.models.RestoreLease``): whether it was taken,
    or ``None`` when PostgreSQL cannot say. Then the scan runs anyway: each restore is one Redis
    transaction on the entry, so two scans at once never restore a message twice."""
    try:
        from cleanup import sql  # noqa: PLC0415 - kombu may load this transport before Django's app registry is ready
        from reservations.db import scalar  # noqa: PLC0415 - as above
    except Exception:  # noqa: BLE001 - without the app (kombu's own suite), no lease to take
        return None
    try:
        taken = scalar(
            sql.TAKE_RESTORE_LEASE, {"holder": _holder(), "seconds": RESTORE_LEASE_SECONDS}
        )
    except Exception as exc:  # noqa: BLE001 - a restore must not wait on the database
        logger.warning(
            "restore lease not taken: scanning without it", extra={"error": repr(exc)[:200]}
        )
        return None
    return taken is not None


def _end_restore_lease() -> None:
    from cleanup import sql  # noqa: PLC0415 - loaded by _take_restore_lease already
    from reservations.db import rows  # noqa: PLC0415 - as above

    try:
        rows(sql.END_RESTORE_LEASE, {"holder": _holder()})
    except Exception:
        logger.warning("restore lease not ended: it runs out", exc_info=True)


def _count_redelivery(envelope: Any) -> None:
    """Count one redelivery of a message about to be restored (the message's own "redelivered"
    mark is only read: cleanup.release.delivery_cap); never raises."""
    try:
        from cleanup.release import delivery_cap  # noqa: PLC0415 - kombu may load this transport before Django's app registry is ready
    except Exception:  # noqa: BLE001 - without the app (kombu's own suite), nothing to count in
        logger.warning("restored messages not counted: the project's apps are not loaded")
        return
    try:
        delivery_cap.count_restored(envelope)
    except Exception:  # counting must never keep a message from its queue
        logger.exception("restored message not counted")


# Every binding this process made, by exchange: put back when the exchange's binding set had to
# be quarantined (it held none of them any more), so routing by that exchange goes on.
_bindings_made: dict[str, set[tuple[str, str, str]]] = {}


class ScreenedPublishBatch(_PublishBatch):
    """kombu's pipelined publish, where a queue key of the wrong type fails only the commands
    for it. A non-transactional pipeline runs every command; the ones that failed are exactly
    those for keys of the wrong type (an LPUSH onto a string). Those keys are quarantined and
    exactly their commands are sent again: sending the whole pipeline again would publish the
    others twice."""

    def flush(self) -> None:
        try:
            stack = list(self.pipeline.command_stack)
        except (AttributeError, TypeError):  # a pipeline without redis-py's command stack
            stack = []
        try:
            super().flush()
        except BatchPublishError as exc:
            if not is_wrong_type(exc.__cause__) or not stack:
                raise
            self._recover(stack)
            self._failed = None  # every message is in its queue: the batch goes on

    def _recover(self, stack: list[tuple[Any, Any]]) -> None:
        pushes = [(args, options) for args, options in stack if _is_push(args)]
        with self.channel.conn_or_acquire() as client:
            moved = set(
                keys.quarantine(
                    client, {bytes_to_str(args[1]): LIST for args, _ in pushes}, "publishing"
                )
            )
        again = [(args, options) for args, options in pushes if bytes_to_str(args[1]) in moved]

        def publish_again() -> None:
            with self.channel.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=False)
                for args, options in again:
                    pipe.execute_command(*args, **options)
                replies = pipe.execute(raise_on_error=False)
            failed = [
                (cmd, r) for cmd, r in zip(again, replies, strict=True) if isinstance(r, Exception)
            ]
            again[:] = [cmd for cmd, _ in failed]
            if failed:
                raise failed[0][1]

        def quarantine_again() -> list[str]:
            with self.channel.conn_or_acquire() as client:
                return keys.quarantine(
                    client, {bytes_to_str(args[1]): LIST for args, _ in again}, "publishing"
                )

        retry_after_quarantine(publish_again, quarantine_again, "publishing")


def _is_push(args: Any) -> bool:
    return bool(args) and len(args) > 1 and bytes_to_str(args[0]).upper() == "LPUSH"


class Channel(_RedisChannel):
    QoS = ScreenedQoS

    # --- keys of the wrong type ------------------------------------------------------------

    def _quarantine_queues(self, queues: Any, where: str) -> list[str]:
        expected: dict[str, str] = {}
        for queue in queues:
            expected.update(keys.queue_keys(queue, self.priority_steps))
        with self.conn_or_acquire() as client:
            return keys.quarantine(client, expected, where)

    def _quarantine_bindings(self, exchange: str) -> list[str]:
        expected = {
            self.keyprefix_queue % (exchange,): SET,
            self.keyprefix_binding_permanent % (exchange,): SET,
        }
        with self.conn_or_acquire() as client:
            moved = keys.quarantine(client, expected, f"the bindings of exchange {exchange!r}")
        if moved:
            for routing_key, pattern, queue in sorted(_bindings_made.get(exchange, ())):
                super()._queue_bind(exchange, routing_key, pattern, queue)
        return moved

    def quarantine_restore_targets(self, exchange: str, routing_key: str) -> list[str]:
        """Before a message is restored by ``(exchange, routing_key)``: its queue's keys, if any
        is of the wrong type."""
        return self._quarantine_queues(self._lookup(exchange, routing_key), "restoring a message")

    def _size(self, queue: str) -> int:
        """kombu's depth reading (a worker's queue declare at start-up makes one), with a key
        of the wrong type quarantined first."""
        size: int = retry_after_quarantine(
            lambda: super(Channel, self)._size(queue),
            lambda: self._quarantine_queues([queue], "reading a queue's depth"),
            "reading a queue's depth",
        )
        return size

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        if kwargs.get("_publish_batch") is not None:
            super()._put(queue, message, **kwargs)  # errors surface at the batch's flush
            return
        retry_after_quarantine(
            lambda: super(Channel, self)._put(queue, message, **kwargs),
            lambda: self._quarantine_queues([queue], "publishing"),
            "publishing",
        )

    def create_publish_batch(self, max_size: int) -> Any:
        return ScreenedPublishBatch(self, max_size)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        _bindings_made.setdefault(exchange, set()).add(
            (routing_key or "", pattern or "", queue or "")
        )
        retry_after_quarantine(
            lambda: super(Channel, self)._queue_bind(exchange, routing_key, pattern, queue),
            lambda: self._quarantine_bindings(exchange),
            "binding a queue",
        )

    def get_table(self, exchange: str) -> Any:
        return retry_after_quarantine(
            lambda: super(Channel, self).get_table(exchange),
            lambda: self._quarantine_bindings(exchange),
            "routing a message",
        )

    # --- reading ----------------------------------------------------------------------------

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
            except redis_py.ResponseError as exc:
                # A queue's key (or one of its priority sub-keys) is not a list: Redis does not
                # say which, so every consumed queue's keys are checked and the wrong ones set
                # aside; the next poll reads on.
                if not is_wrong_type(exc):
                    raise
                self._quarantine_queues(list(self.active_queues), "consuming")
                raise Empty() from None
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
                name = self._q_for_pri(queue, pri)
                try:
                    item = client.rpop(name)
                except redis_py.ResponseError as exc:
                    if not is_wrong_type(exc):
                        raise
                    keys.quarantine(client, {name: LIST}, "consuming")
                    continue
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    payload = screen_entry(item, queue)
                    if payload is None:
                        raise Empty()  # dead-lettered; the next poll reads on
                    return payload
            self._maybe_update_queues_expire(client, queue)
            raise Empty()


class Transport(_RedisTransport):
    Channel = Channel


# --- Redis Sentinel ---------------------------------------------------------------------------
#
# kombu's Sentinel channel is a subclass of kombu's own Redis channel: it changes only how the
# connection pool is made (ask the sentinels for the master of ``master_name``, through
# redis-py's ``SentinelManagedConnection``, which asks again on every reconnect) and the
# fan-out topics. Used as it is, a sentinel:// broker would get none of the screening above.
# The screened channel comes first in the bases, so every method it overrides is the one that
# runs; kombu's Sentinel channel comes next, so its pool and fan-out methods (which the screened
# channel does not touch) are the ones used; both reach kombu's own channel through ``super()``.
# tests/unit/reservations/test_redis_sentinel.py checks the method resolution and fails when kombu's
# Sentinel channel starts overriding one of the screened methods.
_SentinelChannel: Any = redis.SentinelChannel
_SentinelTransport: Any = redis.SentinelTransport


class SentinelChannel(Channel, _SentinelChannel):
    QoS = ScreenedQoS

    def _get_pool(self, asynchronous: bool = False) -> Any:
        """kombu's Sentinel pool, refused with a connection error once the broker connection
        is gone.

        When the master dies, Celery releases the dead connection; closing the channel restores
        its unacknowledged messages, which needs a new pool, and kombu builds it from
        ``self.connection.client``, already ``None`` by then: the ``AttributeError`` is not a
        connection error, so Celery took it as fatal and the worker exited (seen in the
        failover drill). A connection error is what Celery's release ignores; the messages stay
        in ``unacked`` and are restored after the visibility timeout, as a lost worker's are.
        """
        if self.connection.client is None:
            raise redis_py.ConnectionError("the broker connection is closed")
        return super()._get_pool(asynchronous)


class SentinelTransport(Transport, _SentinelTransport):
    Channel = SentinelChannel
    default_port = _SentinelTransport.default_port


# kombu keeps every ``sentinel://`` URL of the broker setting as a failover alternate, and when a
# connection attempt fails it switches to the next one by parsing that URL, which sets the
# transport to the URL's scheme whatever the ``broker_transport`` setting names: the worker
# would reconnect, mid-failover, on kombu's own unscreened Sentinel transport. The scheme's
# alias names this transport instead. The first broker connection of a process loads this
# module (``broker_transport``), so the alias is in place before any switch can happen.
TRANSPORT_ALIASES["sentinel"] = f"{__name__}:SentinelTransport"
