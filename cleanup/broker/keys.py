"""Redis keys of the wrong type, quarantined so that one planted key never stops a fleet.

kombu keeps a queue as a list per priority step, its ack emulation in a hash (``unacked``) and
a sorted set (``unacked_index``), and each exchange's bindings in sets
(``_kombu.binding.<exchange>``).
Anything that can write to Redis can replace one of them with a value of another type. Redis
then answers every command on that key with ``WRONGTYPE``, which is not one of kombu's
connection errors: from ``BRPOP`` it stopped every worker, from the ack bookkeeping it stopped
each worker on its next delivery, and from the binding set it stopped every publish. (kombu's
restore lock, ``unacked_mutex``, is not used: the restore runs under a lease in PostgreSQL.)

``quarantine`` renames such a key out of the way (atomically: a Lua script checks the type and
renames in one step, so a key that became right in between is left alone), keeps the renamed
copy for ``KEPT_SECONDS`` for whoever investigates, logs it and counts it in
``reservation_cleanup_broker_keys_set_aside_total{key}``. A key of the wrong type holds nothing
the project or kombu wrote (a Redis key has one type), so nothing is lost by moving it.

The readers (``cleanup.broker.readers``) never change what they read: they report such a key
as unreadable. Docs: docs/HARDENING.md, "Keys of the wrong type".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import redis

from cleanup import metrics

logger = logging.getLogger("cleanup.broker.keys")

# Where a quarantined key goes, and how long the copy is kept there.
QUARANTINE_PREFIX = "reservation-cleanup:set-aside:"
KEPT_SECONDS = 7 * 86400

# kombu's separator between a queue's name and its priority step (kombu.transport.redis).
PRIORITY_SEP = "\x06\x16"

# Redis types as TYPE names them.
LIST, HASH, ZSET, SET, STRING = "list", "hash", "zset", "set", "string"

# KEYS[1] the key, KEYS[2] where it goes; ARGV[1] the type it must have, ARGV[2] the longest
# expiry (ms) a string may have, or -1 when any expiry (none included) is fine; ARGV[3] how long
# the copy is kept (ms). Returns the type that was quarantined, or false when the key is absent
# or as it should be.
_SET_ASIDE_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then return false end
if kind == ARGV[1] then
  local longest = tonumber(ARGV[2])
  if longest < 0 then return false end
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl >= 0 and ttl <= longest then return false end
  kind = kind .. (ttl < 0 and ' without expiry' or ' with a longer expiry')
end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return kind
"""


def is_wrong_type(exc: BaseException) -> bool:
    """Redis's answer to a command on a key holding another type of value."""
    if not isinstance(exc, redis.ResponseError):
        return False
    text = str(exc)
    # A pipeline's error names the command first ("Command # 2 (HSET ...) of pipeline caused
    # error: WRONGTYPE ...").
    return text.startswith("WRONGTYPE") or "caused error: WRONGTYPE" in text


def describe(key: str | bytes) -> str:
    """A key's name as logs and the metric label show it (a priority sub-key's separator is
    two control characters)."""
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    name, sep, step = text.partition(PRIORITY_SEP)
    return f"{name} (priority {step})" if sep else text


def quarantine(
    client: Any,
    expected: dict[str, str],
    where: str,
    *,
    longest_expiry_ms: int = -1,
) -> list[str]:
    """Move every key of ``expected`` whose type is not the one given out of the way; return
    the keys moved. ``longest_expiry_ms`` (strings only) also moves a string that has no expiry
    or a longer one than that (a lock planted to be held forever). Never raises but for the
    connection: a failure here is logged, and the caller's command fails as it would have."""
    moved: list[str] = []
    stamp = int(time.time() * 1000)
    for key, kind in expected.items():
        target = f"{QUARANTINE_PREFIX}{key}:{stamp}"
        try:
            found = client.eval(
                _SET_ASIDE_SCRIPT,
                2,
                key,
                target,
                kind,
                longest_expiry_ms if kind == STRING else -1,
                KEPT_SECONDS * 1000,
            )
        except redis.ConnectionError:
            raise
        except redis.RedisError:
            logger.exception("could not set a broker key aside", extra={"key": describe(key)})
            continue
        if found:
            found_kind = found.decode() if isinstance(found, bytes) else str(found)
            moved.append(key)
            metrics.record_key_quarantined(describe(key))
            logger.error(
                "broker key of the wrong type quarantined",
                extra={
                    "key": describe(key),
                    "found": found_kind,
                    "expected": kind,
                    "moved_to": describe(target),
                    "where": where,
                },
            )
    return moved


def queue_keys(queue: str, priority_steps: Iterable[int]) -> dict[str, str]:
    """Every list kombu keeps for ``queue``: the bare name for step 0, then one per step."""
    return {
        (queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}"): LIST for step in priority_steps
    }
