"""What the sweeps of a drill cost, from its workers' ``sweep done`` log lines.

    .venv/bin/python bench/sweep_time.py DIR [DIR ...]

DIR is a burst drill's ``--out`` folder (``worker*.log`` in it; the logs are not committed). For
each: the sweeps, the pool-process seconds they took (their ``duration_s``) and the mean, how
many published nothing, the same inside the backpressure window (from the first sweep that ended
paused by backpressure to the last), and each shard's published holds every 20 s (cumulative),
which shows whether the shards took turns.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass
class Sweep:
    at: datetime
    shard: str
    published: int
    backpressure: bool
    duration_s: float


def sweeps(folder: Path) -> list[Sweep]:
    found = []
    for log in sorted(folder.glob("worker*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if " cleanup.sweep sweep done " not in line:
                continue
            fields = dict(FIELD.findall(line))
            found.append(
                Sweep(
                    at=datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC),
                    shard=fields["shard"],
                    published=int(fields["published"]),
                    backpressure=fields["backpressure"] == "True",
                    duration_s=float(fields["duration_s"]),
                )
            )
    return sorted(found, key=lambda s: s.at)


def summary(runs: list[Sweep]) -> str:
    if not runs:
        return "no sweeps"
    seconds = [s.duration_s for s in runs]
    idle = [s.duration_s for s in runs if not s.published]
    return (
        f"{len(runs)} sweeps, {sum(seconds):.1f} process-s, mean {statistics.mean(seconds):.3f} s, "
        f"median {statistics.median(seconds):.3f} s; {len(idle)} published nothing "
        f"({sum(idle):.1f} s)"
    )


def report(folder: Path) -> None:
    runs = sweeps(folder)
    print(f"{folder}: {summary(runs)}")
    if not runs:
        return
    start = runs[0].at
    paused = [s.at for s in runs if s.backpressure]
    if paused:
        window = [s for s in runs if paused[0] <= s.at <= paused[-1]]
        width = (paused[-1] - paused[0]).total_seconds()
        busy = sum(s.duration_s for s in window)
        print(
            f"  backpressure window {(paused[0] - start).total_seconds():.0f}–"
            f"{(paused[-1] - start).total_seconds():.0f} s: {summary(window)}; "
            f"{busy / width if width else 0:.2f} of one pool process"
        )
    end = (runs[-1].at - start).total_seconds()
    for shard in sorted({s.shard for s in runs}):
        mine = [s for s in runs if s.shard == shard]
        steps = range(20, int(end) + 20, 20)
        cumulative = [
            sum(s.published for s in mine if (s.at - start).total_seconds() <= t) for t in steps
        ]
        print(f"  shard {shard}: published by every 20 s {cumulative}")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    for arg in sys.argv[1:]:
        report(Path(arg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
