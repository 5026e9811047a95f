"""Small server-rendered SVG line charts for the health page (no JavaScript, no CDN)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from cleanup.models import HealthSample

WIDTH, HEIGHT, PAD = 560, 120, 34


def _line(
    title: str, unit: str, points: Sequence[tuple[datetime, float | None]], color: str
) -> SafeString:
    known = [(t, v) for t, v in points if v is not None]
    if not known:
        body = f'<text x="{PAD}" y="{HEIGHT // 2}" class="empty">no samples yet</text>'
        peak = 0.0
    else:
        t0 = known[0][0].timestamp()
        span = max(known[-1][0].timestamp() - t0, 1.0)
        peak = max(v for _, v in known)
        scale = peak or 1.0
        xy = [
            (
                PAD + (t.timestamp() - t0) / span * (WIDTH - 2 * PAD),
                HEIGHT - PAD - v / scale * (HEIGHT - 2 * PAD),
            )
            for t, v in known
        ]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{color}"/>' for x, y in xy)
        body = (
            f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>{dots}'
            f'<text x="{PAD - 4}" y="{PAD + 4}" text-anchor="end" class="axis">{_fmt(peak)}</text>'
            f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end" class="axis">0</text>'
            f'<text x="{PAD}" y="{HEIGHT - 8}" class="axis">{known[0][0]:%H:%M}</text>'
            f'<text x="{WIDTH - PAD}" y="{HEIGHT - 8}" text-anchor="end" class="axis">'
            f"{known[-1][0]:%H:%M}</text>"
        )
    last = known[-1][1] if known else None
    label = escape(title)
    return mark_safe(  # every value above is a number or escaped
        f'<svg role="img" aria-label="{label}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" class="health-chart">'
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="none" stroke="#ccc"/>'
        f'<text x="{PAD}" y="16" class="title">{label}: last {_fmt(last)} {escape(unit)}, '
        f"peak {_fmt(peak if known else None)}</text>"
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" '
        f'stroke="#999"/>{body}</svg>'
    )


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def chart_svg(samples: Sequence[HealthSample]) -> list[SafeString]:
    return [
        _line(
            "Oldest eligible hold",
            "s",
            [(s.taken_at, s.oldest_eligible_age_seconds) for s in samples],
            "#ba2121",
        ),
        _line(
            "Release queue depth",
            "messages",
            [
                (s.taken_at, None if s.queue_depth is None else float(s.queue_depth))
                for s in samples
            ],
            "#417690",
        ),
        _line(
            "Releases per minute",
            "/min",
            [(s.taken_at, float(s.released_last_minute)) for s in samples],
            "#3a7d44",
        ),
    ]
