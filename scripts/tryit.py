"""The README's try-it story: the shell lines between its try-it markers. ``scripts/run.py``
prints them once the system is up; ``tests/integration/test_try_it.py`` runs them and checks
each line's ``# →`` comment (what the line prints, ``…`` standing for the rest), so the README,
what run.sh prints and what the test runs are the same lines."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
START = "<!-- try-it:start -->"
END = "<!-- try-it:end -->"
EXPECT = "# →"
ELLIPSIS = "…"


@dataclass(frozen=True)
class Step:
    line: str  # as written in the README, its comment included
    expect: tuple[str, ...]  # fragments the output shows, in this order


def story_lines(text: str) -> list[str]:
    """The lines of the fenced block between the markers (fences excluded)."""
    if START not in text or END not in text:
        raise ValueError(f"no {START} ... {END} block")
    block = text.split(START, 1)[1].split(END, 1)[0].strip().splitlines()
    if len(block) < 2 or not block[0].startswith("```") or block[-1].strip() != "```":
        raise ValueError("the try-it block must be one fenced code block")
    return block[1:-1]


def steps(lines: list[str]) -> list[Step]:
    """Each line that is not blank or a comment, with what its ``# →`` comment expects."""
    found: list[Step] = []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        expect: tuple[str, ...] = ()
        if EXPECT in line:
            comment = line.split(EXPECT, 1)[1]
            expect = tuple(part.strip() for part in comment.split(ELLIPSIS) if part.strip())
        found.append(Step(line, expect))
    return found


def read(readme: Path = README) -> list[str]:
    return story_lines(readme.read_text(encoding="utf-8"))
