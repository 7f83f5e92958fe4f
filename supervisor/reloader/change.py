"""What to do with a change: skip it, apply it at runtime, or reload. Pure."""

from __future__ import annotations

from typing import Literal

Action = Literal["skip", "runtime", "reload"]

# What a worker runs, or should: (effective sha256, watched files' digest; None when unknown).
Runs = tuple[str, str | None]


def decide_change(current: Runs | None, goal: Runs, *, force: bool, runtime_apply: bool) -> Action:
    """skip: the current worker runs the goal already and no reload is forced. runtime: the
    watched files are as the current worker loaded them and a runtime apply is plugged in, so
    only the config changed and the runtime API may carry it (it falls back to a reload when it
    cannot). reload: anything else, a forced reload always, and whatever there is no current
    worker for. The runtime and the reload both follow `haproxy -c` passing."""
    if current == goal and not force:
        return "skip"
    if runtime_apply and current is not None and not force and current[1] == goal[1]:
        return "runtime"
    return "reload"
