"""What a burst drill is asked to do (``BurstConfig``) and what it saw (``BurstState``,
one ``Sample`` per second)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any


@dataclass
class BurstConfig:
    holds: int = 12000
    window: float = 300.0
    offerings: int = 8
    shards: int = 4
    lead: float = 3.0  # seconds before the first hold expires
    renew_fraction: float = 0.0
    duplicate_fraction: float = 0.0
    drain_at: float | None = None
    kill_at: float | None = None
    workers: int = 0
    concurrency: int = 1
    send_sweeps: bool = True
    sweep_every: float = 2.0
    slo: float = 300.0
    timeout: float | None = None
    out: Path = Path("reports/burst")
    seed: int = 1
    set_based: int = 0  # holds for the set-based release after the drain (0: none)


@dataclass
class Sample:
    t: float
    eligible: int
    oldest_eligible_s: float | None
    oldest_by_shard: dict[str, float]
    queue_depth: int
    oldest_message_s: float | None
    unacked: int | None
    released: int
    attempts: int  # release attempts, one per hold (the tally), since the drill began
    redeliveries: int  # redeliveries counted for the drill's keys
    receipts: int
    outcomes: dict[str, int]
    retries: int
    dead_letters: int
    renewed: int
    duplicates: int
    workers_alive: int


@dataclass
class BurstState:
    ids: list[int] = field(default_factory=list)
    renew_set: set[int] = field(default_factory=set)
    renewed: list[int] = field(default_factory=list)
    renew_missed: int = 0
    seen_messages: set[str] = field(default_factory=set)  # delivery tags the drill looked at
    duplicate_messages: int = 0  # release messages delivered twice
    duplicates: int = 0  # the holds those copies carried
    # (expires_at, id) of the renew set, soonest first, and the ids whose time has come that
    # the drill is still asking about.
    renew_schedule: list[tuple[datetime, int]] = field(default_factory=list)
    renew_window: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # The attempt tally when the drill began: its first minute and that minute's count.
    tally_minute: int = 0
    tally_before: int = 0
