"""What the soak drill (bench/soak.py) concludes from its samples: whether a series grew in the
run's second half, by thresholds stated here, and the half/end values of report.json.

A series is a list of ``(t, value)`` (seconds since traffic began). The second half is split in
two quarters, and a series **grew** when the mean of the last quarter exceeds the mean of the
third by more than its threshold: relative to the third quarter's mean, and by more than an
absolute floor, so that a table of ten rows gaining two is noise and a process whose RSS wobbles
by a few hundred KiB is flat. Whole quarters, not a fitted slope: the bursts make every
retained table a saw tooth (a burst's receipts arrive at once and leave together a retention
later), which a slope over a few teeth reads as growth or shrinkage depending on where the run
ends; a quarter of an hour's run holds several teeth, and their means compare.

Nothing here reads the clock, the database or the broker: tests/unit/bench/test_soak.py runs it
on made-up series.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from statistics import fmean
from typing import Any

Series = Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Threshold:
    """Growth allowed from the third quarter's mean to the last's: ``relative`` of the former
    and at least ``absolute`` (in the series' unit) before a series counts as grown."""

    relative: float
    absolute: float


# Resident memory (MiB) of each process: 5 %, and at least 3 MiB.
RSS = Threshold(relative=0.05, absolute=3.0)
# Rows of a table: 10 %, and at least 50 rows.
ROWS = Threshold(relative=0.10, absolute=50.0)
# Keys of the drill's Redis database and lengths of its lists: 10 %, and at least 5.
KEYS = Threshold(relative=0.10, absolute=5.0)
# The oldest eligible hold, in seconds, at every sample of the run.
OLDEST_ELIGIBLE_LIMIT_S = 10.0


@dataclass(frozen=True)
class Growth:
    third_quarter_mean: float | None
    last_quarter_mean: float | None
    change: float | None  # last - third
    relative: float | None  # change / third (None when the third quarter's mean is 0)
    grew: bool
    samples: int


def quarters(series: Series, end: float) -> tuple[list[float], list[float]]:
    """The values of the third quarter [end/2, 3 end/4) and the last [3 end/4, end]."""
    half, three = end / 2, end * 3 / 4
    third = [v for t, v in series if half <= t < three]
    last = [v for t, v in series if three <= t <= end]
    return third, last


def growth(series: Series, end: float, threshold: Threshold) -> Growth:
    """Whether ``series`` grew over the second half of a run that ended at ``end``."""
    third, last = quarters(series, end)
    if not third or not last:
        return Growth(None, None, None, None, False, len(third) + len(last))
    before, after = fmean(third), fmean(last)
    change = after - before
    relative = change / before if before else None
    allowed = max(threshold.absolute, threshold.relative * abs(before))
    return Growth(
        round(before, 3),
        round(after, 3),
        round(change, 3),
        None if relative is None else round(relative, 4),
        change > allowed,
        len(third) + len(last),
    )


def value_at(series: Series, t: float) -> float | None:
    """The value of the last sample at or before ``t`` (the first one if none is)."""
    if not series:
        return None
    before = [v for at, v in series if at <= t]
    return before[-1] if before else series[0][1]


def judge(
    kinds: Mapping[str, tuple[Threshold, Mapping[str, Series]]], end: float
) -> dict[str, dict[str, Any]]:
    """``{kind: {series name: growth}}`` for every series, with its threshold."""
    out: dict[str, dict[str, Any]] = {}
    for kind, (threshold, named) in kinds.items():
        out[kind] = {
            name: {**asdict(growth(series, end, threshold)), "threshold": asdict(threshold)}
            for name, series in named.items()
        }
    return out


def grown(judged: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """``kind:name`` of every series that grew."""
    return [
        f"{kind}:{name}"
        for kind, named in judged.items()
        for name, verdict in named.items()
        if verdict["grew"]
    ]
