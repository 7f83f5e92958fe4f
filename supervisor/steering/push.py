"""One worker's map brought to its plan through the master CLI, and read back. A push runs in two
stages, steer() then tidy(), so that a round steers every worker before it tidies any."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..haproxy.answers import parse_prepare_map, parse_show_sess
from ..haproxy.api import CLIError, MasterCLI, on_process
from .mapdiff import (
    PHASES,
    ROUTING_PHASES,
    BackendDelta,
    Phase,
    answer_problem,
    delta_lines,
    is_whole_answer,
    map_entries,
    phase_lines,
    valid_entry,
)
from .plan import Entries, Steering

# Above this many `set map`/`del map` commands for one worker the whole map is replaced
# (prepare/commit): each such command is a CLI round of its own, while a replacement ships
# every entry in a few payloads and switches atomically.
REPLACE_ABOVE = 64
GONE = "Can't find the target PID"  # the master's answer for a worker that exited


class PushError(Exception):
    """A push or its read-back did not give the map we wanted (one line)."""


@dataclass(frozen=True)
class PushOutcome:
    """What one push did, for rounds.py to apply."""

    held: Mapping[str, Entries] | None  # what its map holds now; None: unknown (read it before the next try)
    sent: int = 0  # changes sent
    pushed: bool = False  # some line was sent: a read-back overlapping it proves nothing
    read_at: float | None = None  # monotonic, when its map was read first (it was unknown)
    steered_at: float | None = None  # monotonic, when its routing phases were answered
    error: str | None = None


@dataclass(frozen=True)
class Outgoing:
    """One worker's push on the wire: routing and tidy-up lines, rank after rank, or the map replaced."""

    sent: int  # changes
    replace: bool = False
    routing: Sequence[list[str]] = ()
    tidy: Sequence[list[str]] = ()


def outgoing(pid: int, map_path: str, wanted: Steering, deltas: Sequence[BackendDelta]) -> Outgoing:
    if sum(d.singles for d in deltas) > REPLACE_ABOVE:
        return Outgoing(len(wanted.entries()), replace=True)
    limit = wanted.digest.limit
    routing = delta_lines(pid, map_path, deltas, limit, PHASES[:ROUTING_PHASES])
    tidy = delta_lines(pid, map_path, deltas, limit, PHASES[ROUTING_PHASES:])
    return Outgoing(sum(d.changes for d in deltas), False, routing, tidy)


@dataclass(frozen=True)
class Steered:
    """A push after its first stage."""

    outcome: PushOutcome  # what the push did if nothing is left to send
    tidy: Sequence[list[str]] = ()  # lines of the later phases, rank after rank


async def steer(cli: MasterCLI, map_path: str, pid: int, wanted: Steering, going: Outgoing | None) -> Steered:
    """Its routing phases sent and answered, or its whole map replaced. `going`: None when its
    map is unknown (read it first)."""
    read_at: float | None = None
    pushed = False
    try:
        if going is None:
            held = await read_map(cli, map_path, pid)
            read_at = time.monotonic()
            delta = BackendDelta.between(held, wanted.entries())
            if not delta.changes:
                return Steered(PushOutcome(wanted.parts, read_at=read_at))
            going = outgoing(pid, map_path, wanted, [delta])
        pushed = True
        if going.replace:
            await replace_map(cli, map_path, pid, wanted.entries(), wanted.digest.limit)
        for lines in going.routing:  # none when the map is replaced
            await send(cli, pid, lines)
        return Steered(PushOutcome(wanted.parts, going.sent, True, read_at, time.monotonic()), going.tidy)
    except (CLIError, PushError, ValueError) as exc:
        return Steered(PushOutcome(None, pushed=pushed, read_at=read_at, error=str(exc)))


async def tidy(cli: MasterCLI, pid: int, steered: Steered) -> PushOutcome:
    try:
        for lines in steered.tidy:
            await send(cli, pid, lines)
    except (CLIError, PushError) as exc:
        return PushOutcome(None, pushed=True, read_at=steered.outcome.read_at, error=str(exc))
    return steered.outcome


async def replace_map(cli: MasterCLI, map_path: str, pid: int, entries: dict[str, str], limit: int) -> None:
    """Swap the whole map at once: a new version filled by payloads, then committed."""
    answer = await cli.on(pid, f"prepare map {map_path}")
    version = parse_prepare_map(answer)
    if version is None:
        raise PushError(f"worker {pid}: prepare map: {answer.strip()[:200]}")
    phase = Phase(adds=tuple(valid_entry(k, v) for k, v in entries.items()))
    await send(cli, pid, phase_lines(pid, map_path, phase, limit, version=version))
    await send(cli, pid, [on_process(pid, f"commit map @{version} {map_path}")])


async def send(cli: MasterCLI, pid: int, lines: list[str]) -> None:
    """Lines that may run in any order, at once; every command must answer cleanly."""
    answers = await asyncio.gather(*(cli.execute(line) for line in lines))
    for line, answer in zip(lines, answers, strict=True):
        problem = answer_problem(line, answer)
        if problem:
            raise PushError(f"worker {pid}: {problem}")


async def read_back(cli: MasterCLI, map_path: str, pids: list[int]) -> list[dict[str, str] | Exception]:
    async def one(pid: int) -> dict[str, str] | Exception:
        try:
            return await read_map(cli, map_path, pid)
        except (CLIError, PushError) as exc:
            return exc

    return list(await asyncio.gather(*(one(pid) for pid in pids)))


def map_difference(expected: Mapping[str, str], got: Mapping[str, str]) -> str | None:
    """What a map read back lacks and holds beyond what was pushed (a few of each), or None."""
    if got == expected:
        return None
    missing = sorted(set(expected.items()) - set(got.items()))[:3]
    extra = sorted(set(got.items()) - set(expected.items()))[:3]
    return f"map differs: missing {missing}, unexpected {extra}"


async def read_map(cli: MasterCLI, map_path: str, pid: int) -> dict[str, str]:
    answer = await cli.on(pid, f"show map {map_path}")
    if not answer:
        # Not even the blank line of an empty map: the master dropped the connection.
        raise PushError(f"worker {pid}: show map: no answer")
    if answer.startswith(GONE) or "Unknown map" in answer:
        raise PushError(f"worker {pid}: {answer.strip().splitlines()[0]}")
    if not is_whole_answer(answer):
        raise PushError(f"worker {pid}: show map: answer cut off after {len(answer)} bytes")
    return map_entries(answer)


# Back stream-connector states (enum sc_state in 2.6; names in some later versions) in
# which a stream is still trying to reach its server: REQ, QUE, TAR, ASS, CON, CER.
_STUCK_STATES = {"1", "2", "3", "4", "5", "6", "REQ", "QUE", "TAR", "ASS", "CON", "CER"}


def stuck_sessions(show_sess_answer: str, dead: frozenset[str], frontend: str | None = None) -> list[str]:
    """The ids of the streams connecting to, or queued on, a dead server (their back side's
    state), from `frontend` only when one is named."""
    return [
        s.id for s in parse_show_sess(show_sess_answer)
        if s.server in dead and s.back_state in _STUCK_STATES and frontend in (None, s.frontend)
    ]


async def end_stuck_streams(cli: MasterCLI, pid: int, dead: frozenset[str], frontend: str | None = None) -> int:
    ids = stuck_sessions(await cli.on(pid, "show sess"), dead, frontend)
    if ids:
        await cli.execute_many([on_process(pid, f"shutdown session {i}") for i in ids])
    return len(ids)
