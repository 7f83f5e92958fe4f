"""The current worker's evidence, read through the master CLI: its server states (rule (b)),
what each old worker skips itself, and the old workers' connections and memory.

Idle means idle: servers change state by themselves only through health checks, agent checks
and `observe`. In a config with none of those, nothing but an admin command can change them
(the daemon's own runtime applies read them again at once), so a full read of the current
worker's states is only a slow safety net. With checks, HAProxy writes each change to its
stderr (haproxy/stderr.py): while those lines are heard, a line is what calls for a read, and
the full read is again a slow safety net (for a line dropped by a full pipe). Polling stays
while they are not heard, and while some check has not concluded yet (right after a reload):
a first check that finds a server UP changes nothing, so HAProxy writes no line for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from ..haproxy.answers import is_servers_state, servers_state_parts, show_info_by_pid
from ..haproxy.api import CLIError, MasterCLI, on_process
from ..state import State
from .record import WorkerRecord
from .states import LiveStates, LiveTally

COST_SHARE = 20  # reads take at most 1/COST_SHARE of the time
# Without HAProxy's lines, servers without checks are still read this often: an operator's
# admin command changes them unheard.
UNHEARD_SAFETY_NET_S = 15.0
STATE_ROWS_PER_PART = 2000  # parsed between two turns of the event loop


def live_read_interval(
    cost_s: float, poll_s: float, safety_net_s: float, *, changes_alone: bool, heard: bool, unchecked: bool = False
) -> float:
    """How long one read of the current worker's server states stays good.
    `changes_alone`: some server is checked or observed, so states change by themselves;
    `heard`: HAProxy's stderr lines reach the daemon (the master's stderr is its FIFO and the
    global section has no `quiet`); `unchecked`: some check has not concluded yet (a first
    check that finds a server UP changes nothing, so no line would come)."""
    if changes_alone and (not heard or unchecked):
        return max(poll_s, COST_SHARE * cost_s)
    return max(poll_s, safety_net_s if heard else min(safety_net_s, UNHEARD_SAFETY_NET_S))


@dataclass(frozen=True)
class LiveRead:
    pid: int
    at: float  # monotonic
    states: LiveStates
    cost_s: float  # asking and parsing
    unusable: frozenset[str]  # its servers that are DOWN or in maintenance

    def due(self, pid: int | None, interval_s: float, now: float) -> bool:
        return pid != self.pid or now - self.at >= interval_s


async def read_states(cli: MasterCLI, pid: int) -> LiveRead:
    """One worker's `show servers state`, asked for and parsed."""
    started = time.monotonic()
    answer = await cli.on(pid, "show servers state")
    if not is_servers_state(answer):
        raise CLIError(f"show servers state: no answer from worker {pid}")
    tally = LiveTally()
    for part in servers_state_parts(answer, STATE_ROWS_PER_PART):
        tally.add(part)
        await asyncio.sleep(0)  # a 10,000-row answer would hold the operator API up
    states = tally.result()
    now = time.monotonic()
    return LiveRead(pid, now, states, now - started, states.unusable())


async def read_unusable(cli: MasterCLI, workers: Iterable[WorkerRecord], budget: int = 4) -> dict[int, LiveRead]:
    """Ask a few old workers not asked yet which servers they skip themselves (DOWN or MAINT in
    their own view): no use as targets. Not in the critical path: a worker is steered first
    with what is known, and corrected when the answer comes. The answers, by PID."""

    async def one(worker: WorkerRecord) -> LiveRead | None:
        with contextlib.suppress(CLIError):
            return await read_states(cli, worker.pid)
        return None

    wanted = [w for w in workers if w.unusable is None and not w.current][:budget]
    reads = await asyncio.gather(*(one(w) for w in wanted))
    return {w.pid: read for w, read in zip(wanted, reads, strict=True) if read is not None}


async def update_stats(cli: MasterCLI, state: State) -> None:
    """Each old worker's current connections (`show info`) and resident memory, for status."""
    pids = list(state.old_workers)
    if not pids:
        return
    answers = await cli.execute_many([on_process(pid, "show info") for pid in pids])
    infos = show_info_by_pid("\n".join(answers))
    stats: dict[int, tuple[int | None, int | None]] = {}
    for pid in pids:
        conns = infos.get(pid, {}).get("CurrConns", "")
        rss: int | None = None
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            rss = psutil.Process(pid).memory_info().rss
        stats[pid] = (int(conns) if conns.isdigit() else None, rss)
    state.publish_old_worker_stats(stats)
