"""Whether a sweep may publish a batch now, and how many holds: the queue's cap, the room the
sweeps ahead in line will take, and whose turn it is near the cap. Each question returns one
decision, ``Take`` or ``Stop``; the sweep (``cleanup.release.sweep``) asks them in order,
holds the locks and records the outcome, and contains no rule of its own.

- ``before_the_line``: before waiting for the publish lock. At the cap, or near it with the room
  already spoken for by the sweeps ahead in line, the sweep leaves at once (a waiting sweep
  holds a pool process that could be releasing).
- ``under_the_lock``: with the publish lock held, read the depth and the room other sweeps
  reserved. A batch is never larger than the room left, so the queue stays within the cap.
  Far from the cap the sweep reserves its batch's room and lets go of the lock before it claims
  and publishes; near the cap the room goes to the shards furthest behind: a sweep whose
  shard's oldest due hold is younger than the oldest due hold of all shards by more than
  ``TURN_SLACK_S`` gives way; the others take at most an equal share of the cap among the
  shards that are behind.
- ``after_the_batch``: whether the run goes on: it ends when its shard had no more due, when
  the batch filled the queue to its cap, or after its share near the cap unless its shard is
  the only one behind (docs/PIPELINE.md "Turns").
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cleanup.broker import readers as broker
from cleanup.release import locks
from cleanup.release.claim import oldest_due_by_shard
from cleanup.release.sizing import ceil_whole

# Near the cap a sweep gives way when its shard's oldest due hold is younger than the oldest due
# hold of all shards by more than this: one sweep interval of the schedule's default (2 s), so a
# shard gives way only once it is a whole round ahead, and readings a few milliseconds apart (or
# holds expiring together) never make every shard leave.
TURN_SLACK_S = 2.0


class Reason(enum.Enum):
    """Why a sweep's run ends (each sets its flags on the sweep's result)."""

    BACKPRESSURE = "backpressure"  # the queue is at its cap, or this batch filled it
    QUEUE_AHEAD = "queue_ahead"  # adaptive mode: the queue outlasts half the release target
    NO_ROOM_AHEAD = "no_room_ahead"  # near the cap, the sweeps ahead in line take the room
    GAVE_WAY = "gave_way"  # near the cap, another shard's oldest due hold is older
    TOOK_SHARE = "took_share"  # near the cap, its share taken: the other shards behind go next
    NOTHING_DUE = "nothing_due"  # the shard has no more due holds
    BUDGET_SPENT = "budget_spent"  # the sweep's own: its time budget or its wait in line ran out


@dataclass(frozen=True)
class Stop:
    """The run ends here. ``message`` is its log line ("" for none), with ``fields`` and the
    turn's readings (if any) beside the shard and the trace id."""

    reason: Reason
    message: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    turn: Turn | None = None


@dataclass(frozen=True)
class Take:
    """Claim and publish at most ``holds`` now. ``depth`` and ``room`` are the readings under
    the publish lock. Far from the cap (``turn`` None) the room is reserved and the publish lock
    let go before the claim; near the cap the lock is held through the publish."""

    holds: int
    depth: int
    room: int
    turn: Turn | None = None

    @property
    def holds_the_lock(self) -> bool:
        return self.turn is not None


@dataclass(frozen=True)
class Turn:
    """Whose turn it is near the cap, from the age of each shard's oldest due hold."""

    shard: int
    own_age: float | None  # None: the shard has no due hold
    furthest: int  # the shard furthest behind (its oldest due hold the oldest)
    furthest_age: float
    behind: int  # shards within TURN_SLACK_S of the furthest behind: they share the room
    query_ms: float = 0.0  # what reading the shards' oldest due holds took

    @property
    def gives_way(self) -> bool:
        return self.own_age is None or self.furthest_age - self.own_age > TURN_SLACK_S

    def as_log(self) -> dict[str, Any]:
        return {
            "oldest_due_s": None if self.own_age is None else round(self.own_age, 2),
            "furthest_behind": self.furthest,
            "furthest_behind_s": round(self.furthest_age, 2),
            "shards_behind": self.behind,
            "turn_query_ms": round(self.query_ms, 2),
        }


def _paused(reason: Reason, **fields: Any) -> Stop:
    return Stop(reason, "sweep paused by backpressure", fields)


def before_the_line(
    queue: str,
    shards: int,
    batch_size: int,
    max_queue_depth: int,
    fleet_starts: Callable[[int], float] | None = None,
) -> Stop | None:
    """A ``Stop`` when a sweep should leave instead of waiting in line for the publish lock;
    None when it should wait. The depth is read again under the lock: that reading, not this
    one, guards the cap (its shard's next sweep comes anyway).

    It leaves when the queue is at its cap, and also near the cap when the room left is
    already spoken for: the sweeps holding or waiting for the publish lock ahead of it take up
    to a fair share each before its turn comes, so ``room <= sweeps ahead × fair share`` means
    it would find the queue full, or claim only what drained during its wait. Not "room
    smaller than one fair share" alone: with nobody ahead a sweep that finds a small room still
    takes it (it is the one whose turn it is, and refilling the queue to its cap is what keeps
    the drain at the rate the cap allows, see ``fair_share``); and when the workers drain less
    than a share between two sweeps (a share is 500 holds at the defaults), that rule would let
    the room build up for rounds and then hand all of it to whichever sweep came first.
    Counting the line keeps today's order of turns: the sweeps already in line take theirs as
    before, and only a sweep that would get nothing (or the crumbs that drained while it
    waited) stops occupying a pool process for its wait.

    The readings are not under the lock, so they can be stale either way: a sweep may leave
    while a sweep ahead was about to let go with room unused (the room waits for the next
    sweep, one sweep interval later at most, with the queue near its cap meanwhile), or join
    the line and find the queue full under the lock as before. Neither affects the cap.

    ``fleet_starts(depth)`` (the adaptive mode's; None in the others) is how many messages the
    fleet starts within half the release target (the shortest budget the sizing gives a batch),
    asked only of a non-empty queue. When the queue already holds that many, the sweep leaves
    too: the holds it would claim wait behind that queue whatever their message's size, so
    claiming them changes no release's time; it leases them early (every claim then reads
    past them) and costs a pool process that could be releasing. Under a flash sale the
    sweeps otherwise claimed the whole backlog into the queue, minutes ahead of the releases,
    on the processes the releases needed (docs/PERFORMANCE.md, "A million holds")."""
    depth = broker.queue_depth(queue)
    if depth >= max_queue_depth:
        return _paused(Reason.BACKPRESSURE, queue_depth=depth)
    if fleet_starts is not None and depth > 0:
        starts = fleet_starts(depth)
        if depth >= starts:
            return _paused(Reason.QUEUE_AHEAD, queue_depth=depth, fleet_starts=round(starts, 1))
    room = max_queue_depth - depth
    if not near_the_cap(room, shards, batch_size):
        return None
    ahead = locks.sessions_in_line(locks.SWEEP_PUBLISH)
    if room <= ahead * fair_share(shards, batch_size, max_queue_depth):
        return _paused(Reason.NO_ROOM_AHEAD, queue_depth=depth)
    return None


def under_the_lock(
    queue: str, shard: int, shards: int, batch_size: int, max_queue_depth: int
) -> Take | Stop:
    """What this batch may claim, decided while the sweep holds the publish lock."""
    depth = broker.queue_depth(queue)
    # what the sweeps that let go of the lock before claiming will still publish
    in_flight = locks.room_reserved_by_others()
    if depth + in_flight >= max_queue_depth:
        return _paused(Reason.BACKPRESSURE, queue_depth=depth, reserved_elsewhere=in_flight)
    # Never past the cap: a batch is at most the room left under it (in holds, so also in
    # messages whatever their size), net of the room other sweeps are publishing into.
    room = max_queue_depth - depth - in_flight
    take = min(batch_size, room)
    if not near_the_cap(room, shards, batch_size):
        # Far from the cap: the room this batch takes stays reserved (keyed by the shard lock,
        # so it lapses with the sweep's session) and the lock goes to the next sweep in line
        # now, not after this claim and publish. The sweeps then claim and publish side by side
        # instead of waiting in line for each other with pool processes that could be
        # releasing; every reading under the lock still counts all batches not yet in the
        # queue, so the cap stays exact.
        return Take(take, depth, room)
    # Near the cap every shard's sweep competes for the same room: the lock is held through
    # the publish, and the turn decides who goes next.
    asked = time.perf_counter()
    ages = oldest_due_by_shard(shards)
    turn = whose_turn(shard, ages, query_ms=(time.perf_counter() - asked) * 1000)
    if turn.own_age is None:
        return Stop(Reason.NOTHING_DUE)
    if turn.gives_way:
        # The room goes to the shards further behind: the SLO is the oldest eligible hold of
        # all shards, and this shard's next sweep comes anyway.
        return Stop(
            Reason.GAVE_WAY,
            "sweep gave way near the cap: another shard's oldest due hold is older",
            {"queue_depth": depth, "room": room},
            turn,
        )
    return Take(min(take, fair_share(turn.behind, batch_size, max_queue_depth)), depth, room, turn)


def after_the_batch(took: Take, claimed: int, messages: int) -> Stop | None:
    """Whether the run ends after a batch that claimed ``claimed`` holds into ``messages``
    release messages; None: it goes on to its next batch."""
    if claimed < took.holds:
        return Stop(Reason.NOTHING_DUE)
    if messages >= took.room:
        # This batch filled the queue to the cap: the same pause as finding it full.
        return _paused(Reason.BACKPRESSURE, queue_depth=took.depth + messages)
    if took.turn is not None and took.turn.behind > 1:
        # Its turn near the cap is over: the other shards (behind) take theirs next. (The only
        # shard behind carries on: nobody else is owed the room, and leaving it unused for a
        # round would lower the drain.)
        return Stop(
            Reason.TOOK_SHARE,
            "sweep took its share of the room near the cap",
            {"queue_depth": took.depth, "room": took.room, "share": took.holds},
            took.turn,
        )
    return None


def whose_turn(shard: int, ages: dict[int, float], query_ms: float = 0.0) -> Turn:
    """Near the cap the room goes to the shards furthest behind. Each shard's claim already
    takes its oldest due holds first, but the sweeps reach the publish lock in the order they
    are sent, so with shares of the cap the first shards in that order took the room round
    after round and the last one's backlog grew older (docs/PERFORMANCE.md). The SLO is the
    oldest eligible hold of all shards: so a shard whose oldest due hold is younger than the
    oldest of all by more than ``TURN_SLACK_S`` gives way, and the shards within the slack of
    the oldest split the cap between them (``fair_share`` of their number). A shard that got
    ahead falls back within the slack as the others catch up, so the shards' oldest holds stay
    within about the slack and a share of each other, whatever order the sweeps come in."""
    if not ages:
        return Turn(shard, None, shard, 0.0, 0, query_ms)
    furthest = max(ages, key=lambda s: (ages[s], -s))
    oldest = ages[furthest]
    behind = sum(1 for age in ages.values() if oldest - age <= TURN_SLACK_S)
    return Turn(shard, ages.get(shard), furthest, oldest, behind, query_ms)


def near_the_cap(room: int, shards: int, batch_size: int) -> bool:
    """True when ``room`` (messages left under the cap) is narrower than every shard's full
    batch together: one sweep's batches could then take the room the other shards need."""
    return shards > 1 and room < shards * batch_size


def fair_share(shards: int, batch_size: int, cap: int) -> int:
    """The most one shard's sweep takes in its turn near the cap: an equal share of the whole
    cap, ceil(cap ÷ shards), never more than a batch. A share of the cap, not of the room left:
    the sweeps take their turns one after another, and shares of a shrinking room add up to
    only 1 - (1 - 1/shards)^shards of it (about two thirds with 4 shards), so the queue would
    never reach its cap and the drain would run below the rate the cap allows."""
    return max(1, min(batch_size, ceil_whole(cap / shards)))
