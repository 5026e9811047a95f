"""The runbook page of the admin (``/admin/cleanup/runbook/``, staff only): RUNBOOK.md (beside
this module) as HTML, one section per alert with the anchor its ``runbook_url`` annotation links to.

The web serves it because it is the one address every deployment already has and an on-call
person can reach from a firing alert; the file in the repository stays the source. The renderer
covers the Markdown that file uses (headings, paragraphs, lists, bold, code spans) and escapes
everything else, so no text of the file can become markup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

# Shipped with the app (an installed package has no docs/ beside it).
RUNBOOK = Path(__file__).with_name("RUNBOOK.md")
_CODE = re.compile(r"`([^`]+)`")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")


def anchor(heading: str) -> str:
    """The id GitHub gives a heading (lower case, punctuation dropped, spaces to hyphens), so a
    link works on the repository's rendering and on this page alike."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _inline(text: str) -> str:
    # Escape first: the substitutions below add the only markup there is.
    html = str(escape(text))
    html = _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", html)
    return _BOLD.sub(lambda m: f"<strong>{m.group(1)}</strong>", html)


@dataclass(frozen=True)
class Section:
    title: str
    anchor: str


def render(markdown: str) -> tuple[SafeString, list[Section]]:
    """HTML of ``markdown`` and its second-level sections, in order."""
    out: list[str] = []
    sections: list[Section] = []
    paragraph: list[str] = []
    items: list[list[str]] = []
    list_tag = ""

    def flush() -> None:
        nonlocal list_tag
        if paragraph:
            out.append(f"<p>{_inline(' '.join(paragraph))}</p>")
            paragraph.clear()
        if items:
            lis = "".join(f"<li>{_inline(' '.join(item))}</li>" for item in items)
            out.append(f"<{list_tag}>{lis}</{list_tag}>")
            items.clear()
            list_tag = ""

    for raw in markdown.splitlines():
        line = raw.rstrip()
        heading = re.match(r"^(#{1,3}) (.+)$", line)
        bullet = re.match(r"^(-|\d+\.) (.+)$", line)
        if heading:
            flush()
            level, title = len(heading.group(1)), heading.group(2)
            if level == 2:
                sections.append(Section(title, anchor(title)))
            out.append(f'<h{level} id="{anchor(title)}">{_inline(title)}</h{level}>')
        elif bullet:
            if paragraph:
                flush()
            list_tag = "ol" if bullet.group(1)[0].isdigit() else "ul"
            items.append([bullet.group(2)])
        elif not line.strip():
            flush()
        elif items and raw.startswith("  "):
            items[-1].append(line.strip())
        else:
            if items:
                flush()
            paragraph.append(line.strip())
    flush()
    # Safe: every piece of text went through escape() in _inline; only our tags are added.
    return mark_safe("\n".join(out)), sections


@cache
def _runbook(path: Path) -> tuple[SafeString, list[Section]]:
    return render(path.read_text(encoding="utf-8"))


def runbook_view(request: HttpRequest) -> HttpResponse:
    html, sections = _runbook(RUNBOOK)
    context = {
        **admin.site.each_context(request),
        "title": "Runbook",
        "subtitle": None,
        "runbook": html,
        "sections": sections,
    }
    return TemplateResponse(request, "admin/cleanup/runbook.html", context)
