"""What the workers say through the master CLI: server states (parsed in parts, so that a big
answer never holds the event loop), and the old workers' connections and memory."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

from ..haproxy.answers import (
    ADMIN_MAINT_MASK,
    ServerKey,
    is_servers_state,
    servers_state_parts,
    servers_state_rows,
    show_info_by_pid,
)
from ..haproxy.api import CLIError, MasterCLI, on_process
from ..state import State

# Where a server is: "<backend> <address>:<port>". One string (a backend name has no blank):
# strings cache their hash, and sets of thousands of them are compared on every drain.
At = str


@dataclass(frozen=True)
class LiveStates:

    down: frozenset[At] = frozenset()  # endpoints where servers are DOWN or MAINT and none is alive
    pending: frozenset[At] = frozenset()  # endpoints whose only servers have not been checked yet
    # Verdicts by "backend/server": every server that is not plainly alive, and those
    # configured by host name (their live address differs from the configured one).
    alive_by_key: dict[str, bool | None] = field(default_factory=dict)

    @functools.cached_property
    def unusable(self) -> frozenset[str]:
        """Its servers that are DOWN or in maintenance: a `use-server` rule skips them."""
        return frozenset(k for k, verdict in self.alive_by_key.items() if verdict is False)


_LIVE_COLUMNS = ("be_name", "srv_name", "srv_addr", "srv_port", "srv_op_state", "srv_admin_state",
                 "srv_check_state", "srv_check_result", "srv_fqdn")  # fmt: skip
_CHECK_RUNNING = 0x02 | 0x04  # CHK_ST_CONFIGURED | CHK_ST_ENABLED
_RUNNING_CHECK_STATES = frozenset(str(v) for v in range(256) if v & _CHECK_RUNNING == _CHECK_RUNNING)
_CHECK_UNKNOWN = "0"  # the check result before the first check concluded


class LiveTally:
    """Fed in parts: the verdict waits for the last part, since an endpoint is down only if no
    part shows a server alive there."""

    def __init__(self) -> None:
        self.down: set[tuple[str, str, str]] = set()
        self.up: set[tuple[str, str, str]] = set()
        self.pending: set[tuple[str, str, str]] = set()
        self.by_key: dict[str, bool | None] = {}

    def add(self, text: str) -> None:
        """Rows of `show servers state`: next to nothing done for the usual row (alive)."""
        down, up, pending, by_key = self.down, self.up, self.pending, self.by_key
        for block in servers_state_rows(text, _LIVE_COLUMNS):
            col = block.at
            i_be, i_name, i_addr = col["be_name"], col["srv_name"], col["srv_addr"]
            i_port, i_op, i_admin = col.get("srv_port"), col["srv_op_state"], col["srv_admin_state"]
            i_cstate, i_cres, i_fqdn = col.get("srv_check_state"), col.get("srv_check_result"), col.get("srv_fqdn")
            for v in block.rows:
                where = (v[i_be], v[i_addr], v[i_port] if i_port is not None else "")
                admin = v[i_admin]
                verdict: bool | None
                if v[i_op] == "0" or (admin != "0" and int(admin) & ADMIN_MAINT_MASK):
                    verdict = False
                    down.add(where)
                elif i_cstate is not None and v[i_cres] == _CHECK_UNKNOWN and v[i_cstate] in _RUNNING_CHECK_STATES:
                    verdict = None
                    pending.add(where)
                else:
                    up.add(where)
                    if i_fqdn is None or v[i_fqdn] == "-":
                        continue  # the usual case: nothing more to note
                    verdict = True
                by_key[ServerKey.of(v[i_be], v[i_name])] = verdict

    def result(self, previous: LiveStates | None = None) -> LiveStates:
        """`previous`, when the states are the same: what was worked out of it is kept, once."""

        def ats(raw: set[tuple[str, str, str]]) -> frozenset[At]:
            return frozenset(f"{b} {a}:{p}" if p.isdigit() else f"{b} {a}" for b, a, p in raw)

        up = self.up
        states = LiveStates(ats(self.down - up), ats(self.pending - up - self.down), dict(self.by_key))
        return previous if states == previous else states


COST_SHARE = 20  # reads take at most 1/COST_SHARE of the time
# Without HAProxy's lines, servers without checks are still read this often: an operator's
# admin command changes them unheard.
UNHEARD_SAFETY_NET_S = 15.0
STATE_ROWS_PER_PART = 2000  # parsed between two turns of the event loop


def live_read_interval(
    cost_s: float, poll_s: float, safety_net_s: float, *, changes_alone: bool, heard: bool, unchecked: bool = False
) -> float:
    """How long one read of the current worker's server states stays good. `changes_alone`: some
    server is checked or observed; `heard`: HAProxy's stderr lines reach the daemon; `unchecked`:
    some check has not concluded yet (a first check that finds a server UP writes no line)."""
    if changes_alone and (not heard or unchecked):
        return max(poll_s, COST_SHARE * cost_s)
    return max(poll_s, safety_net_s if heard else min(safety_net_s, UNHEARD_SAFETY_NET_S))


@dataclass(frozen=True)
class LiveRead:
    pid: int
    at: float  # monotonic
    states: LiveStates
    cost_s: float  # asking and parsing


async def read_states(cli: MasterCLI, pid: int, previous: LiveStates | None = None) -> LiveRead:
    started = time.monotonic()
    answer = await cli.on(pid, "show servers state")
    if not is_servers_state(answer):
        raise CLIError(f"show servers state: no answer from worker {pid}")
    tally = LiveTally()
    for part in servers_state_parts(answer, STATE_ROWS_PER_PART):
        tally.add(part)
        await asyncio.sleep(0)  # a 10,000-row answer would hold the operator API up
    states = tally.result(previous)
    now = time.monotonic()
    return LiveRead(pid, now, states, now - started)


async def read_unusable(cli: MasterCLI, unasked: Iterable[int], budget: int = 4) -> dict[int, LiveRead]:
    """Which servers a few old workers skip themselves (DOWN or MAINT in their own view). Off
    the critical path: a worker is steered with what is known."""

    async def one(pid: int) -> LiveRead | None:
        with contextlib.suppress(CLIError):
            return await read_states(cli, pid)
        return None

    wanted = list(unasked)[:budget]
    reads = await asyncio.gather(*(one(pid) for pid in wanted))
    return {pid: read for pid, read in zip(wanted, reads, strict=True) if read is not None}


async def update_stats(cli: MasterCLI, state: State) -> None:
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
