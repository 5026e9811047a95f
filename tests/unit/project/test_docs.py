"""The front door: the README stays a short front page, the license is the one it says, and
every relative link in the README, CONTRIBUTING, CHANGELOG and docs/ leads to a file (and, with
a ``#fragment``, a heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import ROOT

README_MAX_LINES = 150
# [text](target) and ![alt](target); the text may span lines (the screenshot's alt does).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)


def documents() -> list[Path]:
    top = [ROOT / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")]
    runbook = ROOT / "cleanup" / "operations" / "console" / "RUNBOOK.md"
    return [*top, runbook, *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are shell, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """The fragments GitHub gives the file's headings: lower case, punctuation dropped, spaces
    as hyphens; a repeated heading gets -1, -2, ..."""
    found: set[str] = set()
    for heading in HEADING.findall(prose(path.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def broken_links(path: Path, text: str) -> list[str]:
    """Each relative link of ``text`` (the content of ``path``) whose file or heading is missing."""
    broken = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    return broken


def test_the_readme_is_a_short_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_license_is_bsd_3_clause() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("BSD 3-Clause License")
    assert "Copyright (c) 2026, the reservation-cleanup authors" in text
    # The third clause is what makes it the 3-clause license.
    assert "Neither the name of the copyright holder nor the names of its" in text


def test_every_doc_is_listed_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [
        name
        for name in [f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")]
        + ["CHANGELOG.md", "CONTRIBUTING.md", "LICENSE"]
        if f"]({name})" not in readme
    ]
    assert missing == []


def test_every_relative_link_in_the_front_door_and_docs_leads_somewhere() -> None:
    broken = [
        problem
        for path in documents()
        for problem in broken_links(path, path.read_text(encoding="utf-8"))
    ]
    assert broken == []


def test_the_link_check_notices_a_missing_file_and_a_missing_heading() -> None:
    readme = ROOT / "README.md"
    text = (
        "[fine](docs/API.md) [gone](docs/NOWHERE.md) [no heading](docs/API.md#no-such-heading)\n"
        "[here](#try-it) `[in code](docs/NOWHERE.md)` [web](https://example.com/x.md)\n"
    )
    assert broken_links(readme, text) == [
        "README.md: docs/NOWHERE.md (no such file)",
        "README.md: docs/API.md#no-such-heading (no such heading)",
    ]
