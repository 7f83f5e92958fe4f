"""The page's charts, as inline SVG: reload durations, push latency, old workers over time."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from ..formats import format_age, format_duration_ms, format_seconds
from ..state import ReloadRecord, State, rfc3339
from .markup import RESULT_TONE, esc

CHART_W, CHART_H = 350, 96
_PLOT_TOP, _PLOT_BOTTOM, _PLOT_LEFT = 14, 82, 2
_TONE_FILL = {"good": "#2f9e44", "bad": "#e03131", "warn": "#f08c00", "neutral": "#868e96"}


def _log_height(value: float, low: float, high: float) -> float:
    """Bar height on a log scale from `low` (nothing) to `high` (the whole plot)."""
    span = math.log10(high) - math.log10(low)
    share = (math.log10(max(value, low)) - math.log10(low)) / span if span > 0 else 1.0
    return max(1.0, share * (_PLOT_BOTTOM - _PLOT_TOP))


def _svg(label: str, body: str, top: str, bottom_left: str, bottom_right: str) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {CHART_W} {CHART_H}" width="{CHART_W}" height="{CHART_H}" role="img" '
        f'aria-label="{esc(label)}">'
        f'<line x1="0" y1="{_PLOT_BOTTOM}" x2="{CHART_W}" y2="{_PLOT_BOTTOM}" class="axis"/>'
        f'<text x="{CHART_W}" y="10" text-anchor="end" class="tick">{esc(top)}</text>'
        f"{body}"
        f'<text x="0" y="{CHART_H - 2}" class="tick">{esc(bottom_left)}</text>'
        f'<text x="{CHART_W}" y="{CHART_H - 2}" text-anchor="end" class="tick">{esc(bottom_right)}</text>'
        "</svg>"
    )


def _empty(label: str, message: str) -> str:
    return _svg(label, f'<text x="{CHART_W / 2}" y="50" text-anchor="middle" class="tick">{esc(message)}</text>',
                "", "", "")


def _bars(
    label: str, noun: str, bars: list[tuple[datetime, float, str, str]], low: float,
    shown: Callable[[float], str], now: datetime,
) -> str:
    """One bar per (when, value, tone, what) in `bars`, oldest left, on a log scale from `low`."""
    if not bars:
        return _empty(label, f"no {noun} yet")
    high = max(max(value for _, value, _, _ in bars), low * 10)
    step = (CHART_W - _PLOT_LEFT) / max(len(bars), 24)
    width = max(1.0, step * 0.7)
    rects = []
    for i, (at, value, tone, what) in enumerate(bars):
        height = _log_height(value, low, high)
        rects.append(
            f'<rect x="{_PLOT_LEFT + i * step:.1f}" y="{_PLOT_BOTTOM - height:.1f}" width="{width:.1f}" '
            f'height="{height:.1f}" fill="{_TONE_FILL[tone]}"><title>{esc(f"{rfc3339(at)} {what}")}</title></rect>'
        )
    worst = max(value for _, value, _, _ in bars)
    since = f"{len(bars)} {noun}, since {format_age((now - bars[0][0]).total_seconds())} ago"
    return _svg(label, "".join(rects), f"max {shown(worst)} (log scale)", since, "now")


def reload_chart(records: Iterable[ReloadRecord], now: datetime) -> str:
    bars = [
        (r.at, r.duration_ms, RESULT_TONE.get(r.result, "neutral"), f"{r.result} {format_duration_ms(r.duration_ms)}")
        for r in records
    ]
    return _bars("Reload durations", "reloads", bars, 1.0, format_duration_ms, now)


def push_chart(points: Iterable[tuple[datetime, float]], now: datetime) -> str:
    bars = [(at, s, "good" if s < 0.1 else "warn" if s < 1 else "bad", format_seconds(s)) for at, s in points]
    return _bars("Push latency", "pushes", bars, 0.001, format_seconds, now)


def old_workers_chart(points: Iterable[tuple[datetime, int]], now: datetime) -> str:
    """A step line of the number of old workers over time, from the first note to now."""
    points = list(points)
    label = "Old workers over time"
    if not points:
        return _empty(label, "not sampled yet")
    start = points[0][0]
    span = max((now - start).total_seconds(), 1.0)
    top = max(max(count for _, count in points), 1)

    def x(at: datetime) -> float:
        return _PLOT_LEFT + (CHART_W - _PLOT_LEFT) * min(1.0, (at - start).total_seconds() / span)

    def y(count: int) -> float:
        return _PLOT_BOTTOM - (_PLOT_BOTTOM - _PLOT_TOP) * count / top

    path = [f"{x(points[0][0]):.1f},{y(points[0][1]):.1f}"]
    for (_, before), (at, count) in itertools.pairwise(points):
        path.append(f"{x(at):.1f},{y(before):.1f}")
        path.append(f"{x(at):.1f},{y(count):.1f}")
    path.append(f"{x(now):.1f},{y(points[-1][1]):.1f}")
    body = (f'<polyline points="{" ".join(path)}" fill="none" stroke="#3b5bdb" stroke-width="1.5">'
            f"<title>{esc(f'now {points[-1][1]}, at most {top}')}</title></polyline>")
    return _svg(label, body, f"max {top}", f"{format_age(span)} ago", f"now {points[-1][1]}")


@dataclass(frozen=True)
class History:
    """What the charts draw, from State's bounded series."""

    reloads: tuple[ReloadRecord, ...] = ()
    pushes: tuple[tuple[datetime, float], ...] = ()
    old_workers: tuple[tuple[datetime, int], ...] = ()

    @classmethod
    def of(cls, state: State) -> History:
        return cls(tuple(state.reloads.chart), tuple(state.push_duration.recent), tuple(state.old_worker_counts))


def charts_html(history: History, now: datetime) -> str:
    pushes = [s for _, s in history.pushes]
    push_note = f"median {format_seconds(statistics.median(pushes))}" if pushes else ""
    charts = [
        ("Reload durations", "green ok, red failed or invalid", reload_chart(history.reloads, now)),
        ("Old workers", "alive over time", old_workers_chart(history.old_workers, now)),
        ("Push latency", push_note, push_chart(history.pushes, now)),
    ]
    return "".join(
        f'<figure style="width: {CHART_W}px"><figcaption>{esc(title)} <span class="muted">{esc(note)}</span>'
        f"</figcaption>{svg}</figure>"
        for title, note, svg in charts
    )

