"""Pure readings of the master CLI's answers about processes: which generation each worker
runs, `show info` answers, and the streams stuck on dead servers."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..haproxy.api import ProcList
from ..state import Generation


def worker_generations(procs: ProcList, generations: Mapping[int, Generation]) -> dict[int, int | None]:
    """Every worker PID of `show proc` (current and old) -> the generation it runs, or None."""
    by_pid = {g.worker_pid: n for n, g in generations.items() if g.worker_pid is not None}
    return {p.pid: by_pid.get(p.pid) for p in (*procs.workers, *procs.old_workers)}


def split_show_info(text: str) -> dict[int, dict[str, str]]:
    """Answers of several `@!<pid> show info` on one line, keyed by each answer's `Pid`."""
    result: dict[int, dict[str, str]] = {}
    block: dict[str, str] = {}

    def close() -> None:
        pid = block.get("Pid", "")
        if pid.isdigit():
            result[int(pid)] = dict(block)

    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "Name" and block:
            close()
            block = {}
        block[key] = value.strip()
    if block:
        close()
    return result


# Back stream-connector states (enum sc_state in 2.6; names in some later versions) in
# which a stream is still trying to reach its server: REQ, QUE, TAR, ASS, CON, CER.
_STUCK_STATES = {"1", "2", "3", "4", "5", "6", "REQ", "QUE", "TAR", "ASS", "CON", "CER"}
_SESS_LINE = re.compile(r"^(0x[0-9a-fA-F]+):.*?\sbe=(\S+)\s+srv=(\S+)\s.*?\sscb=\[(\w+),")


def stuck_sessions(show_sess_answer: str, dead: frozenset[str]) -> list[str]:
    """Streams connecting to, or queued on, a dead server: the ids `shutdown session` takes.

    `show sess` (2.6) prints one line per stream, `... be=<backend> srv=<server> ...
    scb=[<state>,<flags>,fd=<n>] ...`; the back side's state says whether it got through.
    """
    ids: list[str] = []
    for line in show_sess_answer.splitlines():
        m = _SESS_LINE.match(line)
        if m and f"{m[2]}/{m[3]}" in dead and m[4] in _STUCK_STATES:
            ids.append(m[1])
    return ids


# ================================================================= the I/O shell


# The poll spends at most 1/LIVE_READ_SHARE of its time reading the current worker's server
