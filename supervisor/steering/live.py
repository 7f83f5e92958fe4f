"""The current worker's evidence, read through the master CLI: its server states (rule (b)),
what each old worker skips itself, and the old workers' connections and memory.

Idle means idle: servers change state by themselves only through health checks, agent checks
and `observe`. In a config with none of those, nothing but an admin command can change them
(the daemon's own runtime applies read them again at once), so a full read of the current
worker's states is only a slow safety net.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import psutil

from ..haproxy.api import CLIError, MasterCLI, on_process
from .dead import LiveStates, parse_live_states
from .procs import split_show_info

SAFETY_NET_S = 15.0  # a read at least this often whatever the config: an operator's admin command
COST_SHARE = 20  # reads take at most 1/COST_SHARE of the time


def live_read_interval(cost_s: float, poll_s: float, changes_alone: bool) -> float:
    """How long one read of the current worker's server states stays good. `changes_alone`:
    some server of its config is health checked or observed, so states change by themselves."""
    return max(poll_s, COST_SHARE * cost_s) if changes_alone else max(poll_s, SAFETY_NET_S)


@dataclass(frozen=True)
class LiveRead:
    pid: int
    at: float  # monotonic
    states: LiveStates
    cost_s: float  # asking and parsing
    unusable: frozenset[str]  # its servers that are DOWN or in maintenance

    def due(self, pid: int | None, poll_s: float, changes_alone: bool, now: float) -> bool:
        return pid != self.pid or now - self.at >= live_read_interval(self.cost_s, poll_s, changes_alone)


async def read_states(cli: MasterCLI, pid: int) -> LiveRead:
    """One worker's `show servers state`, asked for and parsed."""
    started = time.monotonic()
    answer = await cli.on(pid, "show servers state")
    if "# be_id" not in answer:
        raise CLIError(f"show servers state: no answer from worker {pid}")
    states = parse_live_states(answer)
    now = time.monotonic()
    return LiveRead(pid, now, states, now - started, states.unusable())


async def read_stats(cli: MasterCLI, pids: list[int]) -> dict[int, tuple[int | None, int | None]]:
    """Per old worker: its current connections (`show info`) and resident memory."""
    answers = await cli.execute_many([on_process(pid, "show info") for pid in pids])
    infos = split_show_info("\n".join(answers))
    stats: dict[int, tuple[int | None, int | None]] = {}
    for pid in pids:
        conns = infos.get(pid, {}).get("CurrConns", "")
        rss = None
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            rss = psutil.Process(pid).memory_info().rss
        stats[pid] = (int(conns) if conns.isdigit() else None, rss)
    return stats
