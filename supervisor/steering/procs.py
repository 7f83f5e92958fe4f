"""Pure readings of the master CLI's answers about processes: which generation each worker
runs, and the streams stuck on dead servers."""

from __future__ import annotations

from collections.abc import Mapping

from ..haproxy.answers import ProcList, parse_show_sess
from ..state import Generation


def worker_generations(procs: ProcList, generations: Mapping[int, Generation]) -> dict[int, int | None]:
    """Every worker PID of `show proc` (current and old) -> the generation it runs, or None."""
    by_pid = {g.worker_pid: n for n, g in generations.items() if g.worker_pid is not None}
    return {p.pid: by_pid.get(p.pid) for p in (*procs.workers, *procs.old_workers)}


# Back stream-connector states (enum sc_state in 2.6; names in some later versions) in
# which a stream is still trying to reach its server: REQ, QUE, TAR, ASS, CON, CER.
_STUCK_STATES = {"1", "2", "3", "4", "5", "6", "REQ", "QUE", "TAR", "ASS", "CON", "CER"}


def stuck_sessions(show_sess_answer: str, dead: frozenset[str]) -> list[str]:
    """Streams connecting to, or queued on, a dead server: the ids `shutdown session` takes.
    The back side's state says whether a stream got through."""
    return [s.id for s in parse_show_sess(show_sess_answer) if s.server in dead and s.back_state in _STUCK_STATES]


# ================================================================= the I/O shell


# The poll spends at most 1/LIVE_READ_SHARE of its time reading the current worker's server
