"""bench/ray_drain.py's runs and tables: per way and app, the median over the runs and the
worst run, so that a column a way loses is never hidden behind another's figure."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._doc import markdown_table
from bench.drain import SLOW_S, Answer, Result, format_seconds

APPS = ("wide", "moved")  # `lost` is deployed but not asked: its only replica vanishes


@dataclass(frozen=True)
class RayMode:
    key: str
    name: str
    observe: bool
    bridge: bool
    abort: bool = True  # with the bridge: the detector destroys stalled sockets (detector.abort)


MODES = (
    RayMode("observe-off", "stock Ray, observe off", False, False),
    RayMode("stock", "stock Ray as it ships (observe on)", True, False),
    RayMode("bridge", "Ray with the bridge", True, True),
    RayMode("bridge-no-abort", "Ray with the bridge, no abort", True, True, abort=False),
)


@dataclass(frozen=True)
class Run:
    """One way, one run: its answers, notes and the evidence recorded beside them."""

    mode: RayMode
    answers: list[Answer]
    notes: dict[str, Any]
    sent_at: list[float]
    evidence: dict[str, Any]

    def of(self, app: str) -> Result:
        return Result(self.mode.name, [a for a in self.answers if a.app == app])


def kept_runs(directory: Path) -> list[Run]:
    """The runs `--keep` wrote (MODE-N.json), the ways in MODES' order."""
    modes = {m.key: m for m in MODES}
    found = []
    for path in sorted(directory.glob("*-*.json")):
        saved = json.loads(path.read_text())
        found.append(Run(modes[saved["mode"]], [Answer(**a) for a in saved["answers"]], saved["notes"],
                         saved.get("sent_at", []), saved.get("evidence", {})))
    return found


def by_app(one: Run) -> str:
    """Failed (and their statuses) and slow requests of each app."""
    parts = []
    for app in APPS:
        mine = one.of(app).answers
        statuses = sorted({a.status for a in mine if a.status != 200})
        answered = f" {statuses}" if statuses else ""
        parts.append(f"{app} failed {sum(a.status != 200 for a in mine)}{answered} "
                     f"slow {sum(a.seconds > SLOW_S for a in mine)}")
    return ", ".join(parts)


def across(values: list[float], show: Callable[[float], str]) -> str:
    """`median (worst)` over the runs: the worst run is never hidden behind the median."""
    if not values:
        return "-"
    return f"{show(statistics.median(values))} ({show(max(values))})"


def count(value: float) -> str:
    return f"{value:g}"


HEADER = ("mode", "runs", *(f"{app}: {what}" for app in APPS for what in ("failed", "slower than 0.5 s")),
          "worst request", "all requests together")
OPERATIONS = ("deploy", "redeploy", "vanish")


def rows(done: list[Run]) -> list[tuple[str, ...]]:
    """One row per way: every figure is the median over its runs, the worst run in brackets."""
    found = []
    for mode in MODES:
        mine = [one for one in done if one.mode == mode]
        if not mine:
            continue
        cells = [mode.name, str(len(mine))]
        for app in APPS:
            cells.append(across([one.of(app).failed for one in mine], count))
            cells.append(across([one.of(app).slow for one in mine], count))
        cells.append(across([max(a.seconds for a in one.answers) for one in mine], format_seconds))
        cells.append(across([sum(a.seconds for a in one.answers) for one in mine], format_seconds))
        found.append(tuple(cells))
    return found


def reloads_at(one: Run, operation: str) -> int:
    """Stock Ray: the head HAProxy processes the operation started (one per render Ray does not
    skip). The bridge: the head daemon's reloads (its /status), runtime applies not counted."""
    by_daemon = one.notes.get("head_daemon_by_operation")
    if by_daemon is not None:
        return by_daemon[operation].get("ok", 0)
    return one.notes["head_haproxy_started"][operation]


def reload_rows(done: list[Run]) -> list[tuple[str, ...]]:
    """Reloads at each Ray operation, median over the runs (worst)."""
    found = []
    for mode in MODES:
        mine = [one for one in done if one.mode == mode]
        if mine:
            found.append((mode.name, *(across([reloads_at(one, op) for one in mine], count) for op in OPERATIONS)))
    return found


def tables(done: list[Run]) -> str:
    """The drain table, then the reloads table; each cell `median (worst run)`."""
    reloads = markdown_table(("mode", *(f"reloads at {op}" for op in OPERATIONS)), reload_rows(done))
    return f"{markdown_table(HEADER, rows(done))}\n\n{reloads}"
