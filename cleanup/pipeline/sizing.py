"""How many holds one release message carries (the adaptive release mode), and the counting
arithmetic it shares with the capacity plan and the pool autoscaler (``cleanup.scaling``, which
sits above the pipeline and imports it from here).

The sweep asks, for each batch it has just claimed: if every message carries one hold, can the
fleet start the last of them before the oldest hold of the batch is ``target_s`` old?

    budget    = target_s − age of the oldest hold in the batch, but at least target_s ÷ 2
    servable  = service rate (messages/s) × budget − messages already waiting ahead
    size      = ceil(due ÷ servable), clamped to [1, cap]

``due`` is the batch, or, when the batch was a full one (more holds are due behind it), the
holds due in all shards and not yet in the queue, whichever is larger: those are the holds the
fleet must start within the budget, and the sweeps will claim them within a round or two. Sized
from the batch alone, a burst of 1,500 holds/s claimed 500 at a time looked servable one hold
per message batch after batch while the holds behind the batches piled up in PostgreSQL, and the
oldest eligible hold peaked past the target (docs/PERFORMANCE.md).

At normal load ``servable`` is far above what a sweep claims, so every message carries one hold
(the per-reservation fan-out). When the queue ahead or the batch itself would outlast the
budget, messages carry more holds: fewer messages for the same holds, so the fleet (whose cost
is mostly per message: Celery's fetch, acknowledgment and task trace) gets through them sooner.
When the queue ahead alone outlasts the budget, the size is the cap. A batch whose oldest hold
is already past the target (held up by an outage, or claimed again after a lost message) is
sized to be started within half the target: it is late whatever the size, and a handful of
late holds that the fleet starts at once need no batching.

This is the autoscaler's drain term turned around: it asks how many consumers clear the waiting
work within the budget; here the consumers are given (their measured rate) and the message
count is what can change.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# Floating-point noise (2.0000000001) must not add a whole consumer or a whole hold.
_EPSILON = 1e-9

# Reasons of a sizing decision (the log line's ``reason``, the counter's label).
KEEPS_UP = "keeps_up"  # one hold per message: the fleet starts the batch within the budget
BACKLOG = "backlog"  # more than one hold per message, below the cap
AT_CAP = "at_cap"  # the arithmetic asks for more than the cap
BEHIND = "behind"  # the queue ahead alone outlasts the budget
REASONS = (KEEPS_UP, BACKLOG, AT_CAP, BEHIND)


def ceil_whole(value: float) -> int:
    """The smallest whole count covering ``value`` (never below 0)."""
    return max(0, math.ceil(value - _EPSILON))


def offered_load(arrival_rate_per_s: float, service_time_s: float) -> float:
    """Busy consumers needed on average (Little's law): λ × S, in consumers."""
    if arrival_rate_per_s < 0 or service_time_s < 0:
        raise ValueError("arrival rate and service time must be >= 0")
    return arrival_rate_per_s * service_time_s


def drain_consumers(waiting: int, service_time_s: float, budget_s: float) -> int:
    """Consumers that clear ``waiting`` messages of ``service_time_s`` each within
    ``budget_s`` (> 0): ceil(waiting × S ÷ budget). The autoscaler's drain term."""
    if budget_s <= 0:
        raise ValueError("budget_s must be > 0")
    return ceil_whole(offered_load(waiting / budget_s, service_time_s))


@dataclass(frozen=True)
class ReleaseSize:
    """One sizing decision with everything it was computed from (logged as is)."""

    size: int  # holds per message
    messages: int  # messages the batch becomes
    reason: str
    claimed: int
    due: int  # holds to serve within the budget: the batch, or the due backlog behind it
    queue_depth: int
    oldest_age_s: float
    rate_per_s: float
    rate_source: str  # "measured" (receipts of the fleet) or "floor" (one consumer assumed)
    target_s: float
    cap: int
    budget_s: float
    servable: float  # messages the fleet can still start within the budget

    def as_log(self) -> dict[str, Any]:
        fields = asdict(self)
        for name in ("oldest_age_s", "rate_per_s", "budget_s", "servable"):
            fields[name] = round(fields[name], 3)
        return fields


def choose_release_size(
    *,
    claimed: int,
    queue_depth: int,
    oldest_age_s: float,
    rate_per_s: float,
    target_s: float,
    cap: int,
    rate_source: str = "measured",
    due: int = 0,
) -> ReleaseSize:
    """Holds per message for a batch of ``claimed`` holds, with ``due`` holds (the batch
    included) to serve within the budget (see the module's docstring)."""
    if cap < 1:
        raise ValueError("cap must be >= 1")
    if target_s <= 0:
        raise ValueError("target_s must be > 0")
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be > 0")
    budget = max(target_s - max(0.0, oldest_age_s), target_s / 2)
    servable = rate_per_s * budget - max(0, queue_depth)
    due = max(claimed, due)
    if claimed <= 1:
        size, reason = 1, KEEPS_UP
    elif servable < 1:
        size, reason = cap, BEHIND
    else:
        wanted = ceil_whole(due / servable)
        if wanted <= 1:
            size, reason = 1, KEEPS_UP
        elif wanted >= cap:
            size, reason = cap, AT_CAP if wanted > cap else BACKLOG
        else:
            size, reason = wanted, BACKLOG
    return ReleaseSize(
        size=size,
        messages=ceil_whole(claimed / size) if claimed > 0 else 0,
        reason=reason,
        claimed=claimed,
        due=due,
        queue_depth=queue_depth,
        oldest_age_s=oldest_age_s,
        rate_per_s=rate_per_s,
        rate_source=rate_source,
        target_s=target_s,
        cap=cap,
        budget_s=budget,
        servable=servable,
    )


def split_evenly(items: list[Any], size: int) -> list[list[Any]]:
    """``items`` in ceil(len ÷ size) consecutive chunks of at most ``size``, as even as
    possible (101 holds at size 50 are 34 + 34 + 33, not 50 + 50 + 1)."""
    if not items:
        return []
    count = ceil_whole(len(items) / max(1, size))
    base, extra = divmod(len(items), count)
    chunks, at = [], 0
    for i in range(count):
        step = base + (1 if i < extra else 0)
        chunks.append(items[at : at + step])
        at += step
    return chunks
