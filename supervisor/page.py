"""The status page at `/`: one self-contained HTML document (no scripts, no external assets) of the
/status document, each backend's size ("b42: 3 of 10 dead") and the charts' history. Dead servers
are grouped per backend, worst first, so that at fleet size every affected backend fits the page."""

from __future__ import annotations

import functools
import html
import itertools
import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .haproxy.config import Config
from .haproxy.resolution import template_names
from .state import Generation, ReloadRecord, State, rfc3339
from .statusclient import format_age, format_bytes, format_duration_ms, format_seconds

# The tone of a reload result, in the chart and in the table.
RESULT_TONE = {
    "ok": "good", "runtime_applied": "good", "skipped_unchanged": "neutral", "failed": "bad", "invalid": "bad",
}
_OPERATOR_TAG = ' <span class="tag">operator</span>'


def esc(value: Any) -> str:
    return html.escape("—" if value is None else str(value), quote=True)


def badge(text: str, tone: str) -> str:
    return f'<span class="badge {tone}">{esc(text)}</span>'


def chips(keys: list[str], operator: frozenset[str] = frozenset()) -> str:
    if not keys:
        return '<span class="muted">none</span>'
    return " ".join(
        f'<span class="chip bad">{esc(key)}{_OPERATOR_TAG if key in operator else ""}</span>' for key in keys
    )


def when(value: str | None, now: datetime) -> str:
    """A time from the document as `2025-01-02 03:04:05` and how long ago; the exact value on hover."""
    if value is None:
        return '<span class="muted">—</span>'
    moment = datetime.fromisoformat(value)
    shown = moment.strftime("%Y-%m-%d %H:%M:%S")
    ago = format_age(max(0.0, (now - moment).total_seconds()))
    return f'<span class="when" title="{esc(value)}">{esc(shown)} <span class="muted">{esc(ago)} ago</span></span>'


def backend_sizes(model: Config) -> dict[str, int]:
    """Servers per backend (and listen) section, templates expanded, backups included."""
    sizes: dict[str, int] = {}
    for section, server_lines in model.server_flags_by_backend():
        lines = [section.body[index].words for index, _flags in server_lines]
        sizes[section.name] = sum(1 if w[0] == "server" else len(template_names(w[1], w[2])) for w in lines)
    return sizes


class BackendSizes:
    """backend_sizes() of the configs HAProxy runs, merged: a backend's largest size among them.
    Kept by effective sha256 while a config runs: a big config is counted once, not per refresh."""

    def __init__(self) -> None:
        self._by_sha: dict[str, dict[str, int]] = {}

    def of(self, generations: Iterable[Generation]) -> dict[str, int]:
        running = {g.effective_sha256: g for g in generations}
        kept = self._by_sha
        self._by_sha = {sha: kept[sha] if sha in kept else backend_sizes(g.model) for sha, g in running.items()}
        merged: dict[str, int] = {}
        for sizes in self._by_sha.values():
            for backend, size in sizes.items():
                merged[backend] = max(size, merged.get(backend, 0))
        return merged


def running_generations(state: State) -> list[Generation]:
    """The generations the current worker and the old workers run (those that are known)."""
    numbers = {state.current_generation, *(w.generation for w in state.old_workers.values())}
    return [state.generations[n] for n in sorted(n for n in numbers if n is not None) if n in state.generations]


@functools.lru_cache(maxsize=128)
def backends_of(steered: tuple[str, ...]) -> frozenset[str]:
    """The backends of `backend/server` keys, kept by content: steered sets seldom change."""
    return frozenset(key.partition("/")[0] for key in steered)


@dataclass(frozen=True)
class BackendDamage:
    """One backend's dead servers, as the page lists them."""

    backend: str
    dead: tuple[str, ...]  # server names, sorted
    size: int | None  # servers it has in the largest running config that has it; None if unknown
    operator: int  # of the dead, how many an operator marked
    steered_in: int  # old workers steered away from at least one of its servers

    @property
    def share(self) -> float:
        return 1.0 if not self.size else min(1.0, len(self.dead) / self.size)

    @property
    def tone(self) -> str:
        return "all" if self.share >= 1.0 else "half" if self.share >= 0.5 else "some"

    @property
    def count(self) -> str:
        """`3 of 10 dead`, or `3 dead` when no running config has the backend."""
        return f"{len(self.dead)} of {self.size} dead" if self.size else f"{len(self.dead)} dead"

    @property
    def label(self) -> str:
        return f"{self.backend}: {self.count}"


def damage_by_backend(
    dead_servers: Iterable[str], operator_dead: Iterable[str], old_workers: Iterable[Mapping[str, Any]],
    sizes: Mapping[str, int],
) -> list[BackendDamage]:
    """Dead servers grouped by backend, worst first: the largest share of the backend dead,
    then the most servers dead, then by name."""
    dead: dict[str, list[str]] = {}
    for key in dead_servers:
        backend, _, server = key.partition("/")
        dead.setdefault(backend, []).append(server)
    by_operator = Counter(key.partition("/")[0] for key in operator_dead)
    steered_in = Counter(backend for worker in old_workers for backend in backends_of(tuple(worker["steered"])))
    damage = [
        BackendDamage(backend, tuple(sorted(servers)), sizes.get(backend), by_operator[backend], steered_in[backend])
        for backend, servers in dead.items()
    ]
    damage.sort(key=lambda d: (-d.share, -len(d.dead), d.size or 0, natural_key(d.backend)))
    return damage


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """`b9` before `b10`: digit runs compare as numbers."""
    return tuple((1, int(part)) if part.isdigit() else (0, part) for part in _DIGITS.split(name) if part)


_DIGITS = re.compile(r"(\d+)")


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
    worst = max(value for _, value, _, _ in bars)
    high = max(worst, low * 10)
    step = (CHART_W - _PLOT_LEFT) / max(len(bars), 24)
    width = max(1.0, step * 0.7)
    rects = []
    for i, (at, value, tone, what) in enumerate(bars):
        height = _log_height(value, low, high)
        rects.append(
            f'<rect x="{_PLOT_LEFT + i * step:.1f}" y="{_PLOT_BOTTOM - height:.1f}" width="{width:.1f}" '
            f'height="{height:.1f}" fill="{_TONE_FILL[tone]}"><title>{esc(f"{rfc3339(at)} {what}")}</title></rect>'
        )
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


PAGE_REFRESH_S = 5
# Up to this many dead servers the page names each one; past it, per backend only (/status has all).
PAGE_CHIP_LIMIT = 40
# An old worker's steered servers are named up to this many; past it, counted.
STEERED_NAMED = 6
# Server names in a backend's tooltip.
TOOLTIP_NAMES = 20

_PUSH_TONE = {"ok": "good", "pending": "warn", "failed": "bad"}

_PAGE_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #f3f5f8; color: #1d2330;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; }
header { background: #1d2330; color: #fff; padding: 14px 24px; display: flex; align-items: center;
  gap: 10px; flex-wrap: wrap; }
header h1 { font-size: 18px; margin: 0 8px 0 0; font-weight: 600; }
header .facts { color: #b9c2d3; font-size: 13px; margin-left: 8px; }
main { padding: 18px 24px; display: grid; gap: 16px; max-width: 1280px; }
.row { display: grid; grid-template-columns: minmax(300px, 2fr) 3fr; gap: 16px; }
@media (max-width: 800px) { .row { grid-template-columns: 1fr; } }
section { background: #fff; border: 1px solid #dde2ea; border-radius: 8px; padding: 14px 16px; min-width: 0; }
h2 { font-size: 15px; margin: 0 0 10px; font-weight: 600; }
h2 .count { color: #6b7587; font-weight: 400; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 4px 10px; border-bottom: 1px solid #edf0f4; vertical-align: baseline; }
tr:last-child td { border-bottom: 0; }
th { font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: #6b7587; font-weight: 600;
  white-space: nowrap; }
td.num, .num { font-variant-numeric: tabular-nums; white-space: nowrap; }
.mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 13px; }
.when { white-space: nowrap; font-variant-numeric: tabular-nums; }
.kv { display: grid; grid-template-columns: max-content 1fr; gap: 4px 18px; margin: 0; }
.kv dt { color: #6b7587; } .kv dd { margin: 0; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600;
  white-space: nowrap; }
.good { background: #dff5e3; color: #17692c; } .bad { background: #fde2e1; color: #a61b1b; }
.warn { background: #fff1cc; color: #7a5200; } .neutral { background: #e8ebf0; color: #444d5c; }
.chip { display: inline-block; margin: 1px 2px; padding: 0 6px; border-radius: 4px; background: #eef1f6;
  font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; white-space: nowrap; }
.chip.bad { background: #fde2e1; color: #a61b1b; }
.chip .tag { font-family: system-ui, sans-serif; font-size: 11px; opacity: .75; }
.counters { display: flex; gap: 10px; flex-wrap: wrap; margin-bottom: 10px; }
.counters div { min-width: 110px; padding: 6px 10px; border-radius: 6px; background: #f6f7f9; }
.counters b { display: block; font-size: 20px; font-variant-numeric: tabular-nums; }
.counters span { color: #6b7587; font-size: 12px; }
.counters .bad { background: #fde2e1; } .counters .bad b { color: #a61b1b; }
.backends { display: grid; gap: 6px; margin: 4px 0 10px; }
.group { display: flex; flex-wrap: wrap; gap: 3px; align-items: baseline; padding: 4px 6px; border-radius: 6px; }
.group .head { font-weight: 600; font-size: 13px; margin-right: 2px; white-space: nowrap; }
.group .n { color: #6b7587; font-size: 12px; margin-right: 6px; white-space: nowrap; }
.group.all { background: #fde2e1; } .group.all .head { color: #a61b1b; }
.group.half { background: #ffe8cc; } .group.half .head { color: #a34a00; }
.group.some { background: #fff6d6; } .group.some .head { color: #6b4800; }
.be { padding: 0 4px; border-radius: 3px; background: rgba(255, 255, 255, .7);
  font: 12px/1.5 ui-monospace, "DejaVu Sans Mono", monospace; white-space: nowrap; }
.be.unsteered { outline: 2px dashed #1d2330; outline-offset: -2px; }
.charts { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; } figcaption { font-size: 13px; font-weight: 600; margin-bottom: 2px; }
figcaption .muted { font-weight: 400; }
svg.chart { display: block; background: #fafbfc; border-radius: 4px; }
svg .axis { stroke: #ced4da; } svg .tick { font-size: 10px; fill: #6b7587; }
.convergence { padding: 6px 10px; border-radius: 6px; margin-bottom: 10px; overflow-wrap: anywhere; }
.convergence .muted { color: inherit; opacity: .8; font-size: 12px; }
.muted { color: #8a93a3; } .err { color: #a61b1b; overflow-wrap: anywhere; }
footer { padding: 0 24px 18px; color: #6b7587; font-size: 12px; }
footer a { color: #3b5bdb; }
"""


def _current_worker_html(worker: dict[str, Any], now: datetime) -> str:
    sha = worker["config_sha256"]
    return (
        '<dl class="kv">'
        f'<dt>PID</dt><dd class="num" id="current-pid">{esc(worker["pid"])}</dd>'
        f'<dt>Generation</dt><dd class="num">{esc(worker["generation"])}</dd>'
        f'<dt>Started</dt><dd>{when(worker["started_at"], now)}</dd>'
        f'<dt>Config</dt><dd class="mono" title="sha256 {esc(sha)}">{esc(sha[:16] if sha else None)}</dd>'
        "</dl>"
    )


def _convergencebadge(convergence: dict[str, Any]) -> str:
    """`converged`, or how long not: amber while it is passing and retried, red when the
    config is the problem (nothing retries it by itself)."""
    if convergence["converged"]:
        return badge("converged", "good")
    tone = "warn" if convergence["transient"] else "bad"
    return (f'<span class="badge {tone}" id="convergence-badge" title="{esc(convergence["reason"])}">'
            f'not converged {esc(format_age(convergence["unconverged_s"]))}</span>')


def _convergence_html(convergence: dict[str, Any], now: datetime) -> str:
    """Why the current worker does not run the rendered config, for the Now panel; nothing when it does."""
    if convergence["converged"]:
        return ""
    attempts = convergence["attempts"]
    if not convergence["transient"]:
        tone, kind = "bad", "the config is the problem: HAProxy serves the last good config until it changes"
    elif attempts:
        tone, kind = "warn", f"passing: retried with backoff ({attempts} attempt{'s' if attempts != 1 else ''} so far)"
    else:
        tone, kind = "warn", "passing: retried with backoff"
    reason = esc(convergence["reason"])
    return (
        f'<div class="convergence {tone}" id="convergence"><b>Not converged</b> since '
        f'{when(convergence["since"], now)}: <span class="reason">{reason}</span>'
        f'<div class="muted">{esc(kind)}</div></div>'
    )


def _summary_html(damage: list[BackendDamage], doc: dict[str, Any]) -> str:
    cells = [
        ("dead servers", len(doc["dead_servers"])),
        ("backends hit", len(damage)),
        ("with no live server", sum(d.tone == "all" for d in damage)),
        ("old workers", len(doc["old_workers"])),
        ("pushes failing", sum(w["push"]["state"] == "failed" for w in doc["old_workers"])),
    ]
    # Any count but the old workers' is trouble when it is not zero.
    return '<div class="counters">' + "".join(
        f'<div class="{"bad" if value and name != "old workers" else ""}"><b>{value:,}</b>'
        f"<span>{esc(name)}</span></div>"
        for name, value in cells
    ) + "</div>"


def _backend_chip(d: BackendDamage, old_workers: int) -> str:
    names = ", ".join(d.dead[:TOOLTIP_NAMES])
    if len(d.dead) > TOOLTIP_NAMES:
        names += f" and {len(d.dead) - TOOLTIP_NAMES} more"
    tip = f"{d.label}: {names}. Steered away in {d.steered_in} of {old_workers} old workers"
    if d.operator:
        tip += f"; {d.operator} marked by an operator"
    unsteered = " unsteered" if old_workers and not d.steered_in else ""
    return f'<span class="be{unsteered}" data-backend="{esc(d.backend)}" title="{esc(tip)}">{esc(d.backend)}</span>'


def _damage_html(damage: list[BackendDamage], doc: dict[str, Any]) -> str:
    """One line per count ("3 of 10 dead"), worst first, naming every backend with that count,
    so that hundreds of backends hit stay a few lines high."""
    if not damage:
        return '<p class="muted">No dead servers.</p>'
    old_workers = len(doc["old_workers"])
    groups = [list(group) for _, group in itertools.groupby(damage, key=lambda d: (d.count, d.tone))]
    rows = "".join(
        f'<div class="group {group[0].tone}" data-count="{esc(group[0].count)}">'
        f'<span class="head">{esc(group[0].count)}</span><span class="n">{len(group):,} '
        f'backend{"s" if len(group) > 1 else ""}</span>'
        + "".join(_backend_chip(d, old_workers) for d in group)
        + "</div>"
        for group in groups
    )
    dead = doc["dead_servers"]
    names = f"<p>{chips(dead, frozenset(doc['operator_dead']))}</p>" if len(dead) <= PAGE_CHIP_LIMIT else ""
    return (
        f'<div class="backends" id="backends">{rows}</div>{names}'
        '<p class="muted">Worst first; hover a backend for its dead servers (all of them are in /status). '
        '<span class="be unsteered">dashed</span>: no old worker is steered away from it. '
        "Old workers are steered away from dead servers. Mark or clear one with "
        '<span class="mono">POST</span> / '
        '<span class="mono">DELETE /servers/&lt;backend&gt;/&lt;server&gt;/dead</span>.</p>'
    )


def _steered_html(steered: list[str]) -> str:
    if len(steered) <= STEERED_NAMED:
        return chips(steered)
    backends = len(backends_of(tuple(steered)))
    return f'<span class="num">{len(steered):,} servers in {backends:,} backends</span>'


def _old_workers_html(workers: list[dict[str, Any]], now: datetime) -> str:
    if not workers:
        return '<p class="muted">No old workers: nothing is draining.</p>'
    rows = []
    for w in workers:
        push = w["push"]
        push_cell = badge(push["state"], _PUSH_TONE.get(push["state"], "neutral"))
        if push["at"]:
            push_cell += f' <span class="muted" title="{esc(push["at"])}">'
            push_cell += f'{esc(format_age((now - datetime.fromisoformat(push["at"])).total_seconds()))} ago</span>'
        if push["error"]:
            push_cell += f'<div class="err">{esc(push["error"])}</div>'
        rows.append(
            f'<tr class="old-worker" data-pid="{esc(w["pid"])}">'
            f'<td class="num pid">{esc(w["pid"])}</td><td class="num">{esc(w["generation"])}</td>'
            f'<td class="num" title="{esc(w["age_s"])} s">{esc(format_age(w["age_s"]))}</td>'
            f'<td class="num">{esc(format_bytes(w["rss_bytes"]))}</td>'
            f'<td class="num">{esc(w["connections"] if w["connections"] is not None else "?")}</td>'
            f'<td class="steered">{_steered_html(w["steered"])}</td><td>{push_cell}</td></tr>'
        )
    return (
        "<table><thead><tr><th>PID</th><th>Gen</th><th>Age</th><th>RSS</th><th>Conns</th>"
        "<th>Steered away from</th><th>Push to worker</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
    )


def _reloads_html(reloads: dict[str, Any], now: datetime) -> str:
    results = [key for key in reloads if key not in ("last", "recent")]
    counters = "".join(
        f'<div class="{"bad" if result in ("failed", "invalid") and reloads[result] else ""}">'
        f'<b>{esc(reloads[result])}</b><span>{esc(result.replace("_", " "))}</span></div>'
        for result in results
    )
    if not reloads["recent"]:
        return f'<div class="counters">{counters}</div><p class="muted">No reloads yet.</p>'
    rows = "".join(
        f'<tr class="reload"><td>{when(r["at"], now)}</td>'
        f'<td>{badge(r["result"].replace("_", " "), RESULT_TONE.get(r["result"], "neutral"))}</td>'
        f'<td class="num">{esc(format_duration_ms(r["duration_ms"]))}</td>'
        f'<td class="err">{esc(r["error"] or "")}</td></tr>'
        for r in reloads["recent"]
    )
    return (
        f'<div class="counters">{counters}</div>'
        "<table><thead><tr><th>When (UTC)</th><th>Result</th><th>Took</th><th>Error</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _suspects_html(suspects: list[dict[str, Any]], now: datetime) -> str:
    if not suspects:
        return '<p class="muted">No suspect servers: no worker socket to a server is stalled.</p>'
    why = {"connect": "connect stalled (SYN-SENT)", "retransmit": "data sent, not acknowledged"}
    rows = "".join(
        f'<tr><td class="mono">{esc(s["server"])}</td><td class="mono">{esc(s["endpoint"])}</td>'
        f'<td>{esc(why.get(s["why"], s["why"]))}{"; left in: its backend has no other way" if s.get("left_in") else ""}'
        f'</td><td>{esc(format_age(s["suspect_s"] or 0))}</td></tr>'
        for s in suspects[:PAGE_CHIP_LIMIT]
    )
    return (f"<table><tr><th>server</th><th>address</th><th>why</th><th>for</th></tr>{rows}</table>"
            '<p class="muted">Seen by the stalled-connection detector: steered off in every worker, '
            "their stalled sockets aborted; a health check that passes brings one back.</p>")


def render_page(doc: dict[str, Any], now: datetime, sizes: Mapping[str, int], history: History) -> str:
    """The page for GET /, every value escaped."""
    sup, hap = doc["supervisor"], doc["haproxy"]
    master = badge("master up", "good") if hap["up"] else badge("master down", "bad")
    ready = badge("ready", "good") if sup["ready"] else badge("not ready", "bad")
    converged = _convergencebadge(doc["convergence"])
    facts = (
        f'supervisor {esc(sup["version"])} · pid {esc(sup["pid"])} · up {esc(format_age(sup["uptime_s"]))}'
        f' · HAProxy {esc(hap["version"])} · master pid {esc(hap["master_pid"])}'
    )
    old, suspects = doc["old_workers"], doc.get("suspect_servers", [])
    damage = damage_by_backend(doc["dead_servers"], doc["operator_dead"], old, sizes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{PAGE_REFRESH_S}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>haproxy-supervisor · {esc(len(old))} old worker(s)</title>
<style>{_PAGE_CSS}</style></head>
<body>
<header><h1>haproxy-supervisor</h1>{master} {ready} {converged}<span class="facts">{facts}</span></header>
<main>
<div class="row">
<section id="current"><h2>Current worker</h2>{_current_worker_html(doc["worker"], now)}</section>
<section id="summary"><h2>Now</h2>{_convergence_html(doc["convergence"], now)}{_summary_html(damage, doc)}</section>
</div>
<section id="dead"><h2>Dead servers by backend <span class="count">({len(doc["dead_servers"]):,} servers in
{len(damage):,} backends)</span></h2>{_damage_html(damage, doc)}</section>
<section id="suspects"><h2>Suspect servers <span class="count">({len(suspects):,})</span>
</h2>{_suspects_html(suspects, now)}</section>
<section id="history"><h2>History</h2><div class="charts">{charts_html(history, now)}</div></section>
<section id="old-workers"><h2>Old workers <span class="count">({esc(len(old))})</span></h2>
{_old_workers_html(old, now)}</section>
<section id="reloads"><h2>Reloads</h2>{_reloads_html(doc["reloads"], now)}</section>
</main>
<footer>Generated {esc(rfc3339(now))} · refreshes every {PAGE_REFRESH_S} s ·
<a href="/status">/status</a> · <a href="/metrics">/metrics</a></footer>
</body></html>
"""


def page_of(state: State, doc: dict[str, Any], now: datetime, sizes: BackendSizes) -> str:
    """render_page() for the daemon; `sizes` lives as long as the app serving the page."""
    return render_page(doc, now, sizes.of(running_generations(state)), History.of(state))
