"""The phased changes from a worker's map to its plan, as master CLI lines: phases keep any request
from seeing a half state (a count promising slots not there yet, say)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..haproxy.answers import parse_show_map, validate_name
from ..haproxy.api import DEFAULT_LINE_LIMIT, batch_lines, on_process
from ..haproxy.guard import HOP_SEPARATOR, backend_of_key, count_key, hop_key, is_count_key, is_hop_key
from .plan import FAIL_FAST, Entries


@dataclass(frozen=True)
class Phase:
    """Map changes that may go in any order, even on parallel connections."""

    adds: tuple[tuple[str, str], ...] = ()
    sets: tuple[tuple[str, str], ...] = ()
    dels: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.adds or self.sets or self.dels)


# Names repeat across workers and pushes: validate each once.
_valid = functools.lru_cache(maxsize=1 << 16)(validate_name)


def diff_phases(current: Mapping[str, str], desired: Mapping[str, str]) -> tuple[Phase, Phase, Phase, Phase, Phase]:
    """The five phases, in order, that turn `current` into `desired` (some may be empty). Once
    the first ROUTING_PHASES are answered every request is routed as `desired` does, or to a
    server it also routes to: the worker is steered. The later ones tidy up.

    0. New entries, in payloads: a newly steered backend's slots then its count, and a hop
       for each server that overrides stop pointing to (haproxy/guard.py), to a server they
       point to now: those overrides, each a command, can then wait for phase 3.
    1. Counts (a count promises the slots below it, so it comes after them), and hops left
       over from an interrupted push.
    2. Slots no longer wanted whose server could get no hop (after the counts that stop
       promising them).
    3. The overrides that moved, and the other slots no longer wanted.
    4. The hops of phase 0, now that nothing points to their servers.

    `desired` holds no hops.
    """
    for key, value in desired.items():
        valid_entry(key, value)

    def split(keys: Iterable[str]) -> tuple[list[str], list[str]]:
        keys = sorted(keys)
        return [k for k in keys if not is_count_key(k)], [k for k in keys if is_count_key(k)]

    slots_wanted, counts_wanted = split(desired)
    slots_had, counts_had = split(k for k in current if k not in desired)

    def changes(keys: list[str]) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
        adds = tuple((k, desired[k]) for k in keys if k not in current)
        sets = tuple((k, desired[k]) for k in keys if k in current and current[k] != desired[k])
        return adds, sets

    slot_adds, slot_sets = changes(slots_wanted)
    count_adds, count_sets = changes(counts_wanted)
    left_over = [k for k in slots_had if is_hop_key(k)]
    slots_gone = [k for k in slots_had if not is_hop_key(k)]
    hops, urgent = _hops(current, desired, slot_sets, slots_gone)
    # A backend steered for the first time needs only adds: its slots and then its count, in
    # one payload, which HAProxy applies in order. That saves the push a round trip, as long
    # as the group is small enough never to be split over two lines (see phase_lines).
    groups: dict[str, list[tuple[str, str]]] = {}
    for key, value in (*slot_adds, *hops.items()):
        groups.setdefault(backend_of_key(key), []).append((key, value))
    late_counts: list[tuple[str, str]] = []
    for key, value in count_adds:
        group = groups.setdefault(backend_of_key(key), [])
        if sum(len(k) + len(v) + 2 for k, v in group) + len(key) + len(value) + 2 <= GROUP_BYTES:
            group.append((key, value))
        else:
            late_counts.append((key, value))

    def is_urgent(key: str) -> bool:
        return current[key] in urgent.get(backend_of_key(key), ())

    return (
        Phase(
            adds=tuple(entry for group in groups.values() for entry in group),
            sets=tuple((k, v) for k, v in slot_sets if is_urgent(k)),
        ),
        Phase(adds=tuple(late_counts), sets=count_sets, dels=tuple(map(_valid_key, (*counts_had, *left_over)))),
        Phase(dels=tuple(_valid_key(k) for k in slots_gone if is_urgent(k))),
        Phase(
            sets=tuple((k, v) for k, v in slot_sets if not is_urgent(k)),
            dels=tuple(_valid_key(k) for k in slots_gone if not is_urgent(k)),
        ),
        Phase(dels=tuple(hops)),
    )


# The phases of diff_phases() after which a worker is steered.
ROUTING_PHASES = 3


def _hops(
    current: Mapping[str, str],
    desired: Mapping[str, str],
    slot_sets: Iterable[tuple[str, str]],
    slots_gone: Iterable[str],
) -> tuple[dict[str, str], dict[str, set[str]]]:
    """The hops of phase 0, and per backend the servers that overrides stop pointing to but
    that get no hop (those overrides must change in the routing phases). A hop goes to the new
    target of one of those overrides, else to any target the backend keeps; none where a
    left-over hop holds the key, or where the backend keeps no target.
    """
    targets: dict[str, set[str]] = {}
    for key, value in desired.items():
        if not is_count_key(key) and not is_hop_key(key):
            targets.setdefault(backend_of_key(key), set()).add(value)
    hops: dict[str, str] = {}
    urgent: dict[str, set[str]] = {}
    moves: list[tuple[str, str | None]] = [*slot_sets, *((key, None) for key in slots_gone)]
    for key, new in moves:
        backend, old = backend_of_key(key), current[key]
        if desired.get(count_key(backend), FAIL_FAST) == FAIL_FAST:
            continue  # not steered, or refused: the count alone decides, in phase 1
        kept = targets.get(backend, set())
        if old in kept:
            continue  # still a target: the worker may keep using it until phase 2
        hop = hop_key(backend, old)
        if hop in hops:
            continue
        if hop in current or not kept:
            urgent.setdefault(backend, set()).add(old)
        else:
            hops[hop] = new if new is not None else min(kept)
    return hops, urgent


# A backend's entries up to this many payload bytes travel together in one line.
GROUP_BYTES = 4000


@functools.lru_cache(maxsize=1 << 16)
def _valid_key(key: str) -> str:
    """A map key that may go on a CLI line: a hop is two names joined by `/`."""
    backend, hop, server = key.partition(HOP_SEPARATOR)
    if hop:
        validate_name("map key", backend)
        validate_name("server", server)
    else:
        validate_name("map key", key)
    return key


def valid_entry(key: str, value: str) -> tuple[str, str]:
    """A map entry whose key and value may go on a CLI line (ValueError otherwise)."""
    return _valid_key(key), _valid("server", value)


@dataclass(frozen=True)
class BackendDelta:
    """diff_phases() with each phase's adds rendered as payload text: a drain changes the same
    backends in dozens of workers, which reuse one delta (backend_delta)."""

    phases: tuple[Phase, ...]
    payloads: tuple[tuple[str, ...], ...]  # each phase's adds: "key value\n" per backend
    changes: int  # entries added, set or deleted
    singles: int  # changes that need a command each (`set map`, `del map`): no payload for those
    single_phases: frozenset[int]  # the phases that have some

    @classmethod
    def between(cls, current: Mapping[str, str], desired: Mapping[str, str]) -> BackendDelta:
        phases = diff_phases(current, desired)
        singles = [len(p.sets) + len(p.dels) for p in phases]
        return cls(
            phases,
            tuple(map(_payload, phases)),
            changes=sum(singles) + sum(len(p.adds) for p in phases),
            singles=sum(singles),
            single_phases=frozenset(i for i, n in enumerate(singles) if n),
        )


@functools.lru_cache(maxsize=1 << 16)
def backend_delta(before: Entries, after: Entries) -> BackendDelta:
    return BackendDelta.between(dict(before), dict(after))


PHASES = range(5)


def _payload(phase: Phase) -> tuple[str, ...]:
    """One string per backend, in order."""
    groups: dict[str, list[str]] = {}
    for key, value in phase.adds:
        groups.setdefault(backend_of_key(key), []).append(f"{key} {value}\n")
    return tuple("".join(group) for group in groups.values())


_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./-]+$")


def _map_path(map_path: str) -> str:
    if not _SAFE_PATH.match(map_path):
        raise ValueError(f"invalid map path {map_path!r}")
    return map_path


def phase_lines(
    pid: int, map_path: str, phase: Phase, limit: int = DEFAULT_LINE_LIMIT, version: int | None = None
) -> list[str]:
    """Lines for the master CLI: sets and deletes joined with `;`, adds as `add map` payloads
    (a few bytes per entry where a command costs ~60, parsed by HAProxy in one go), each line
    within `limit`. `version`: add to that version of the map (from `prepare map`)."""
    path = _map_path(map_path)
    at_version = f"@{int(version)} " if version is not None else ""
    head = on_process(pid, f"add map {at_version}{path} <<\n")
    lines, late = _rank_lines(head, _commands(pid, path, phase), _payload(phase), limit)
    return lines + late  # callers that need the late ones later use delta_lines


def _rank_lines(head: str, commands: list[str], groups: Iterable[str], limit: int) -> tuple[list[str], list[str]]:
    payloads, late = payload_lines(head, groups, limit)
    return batch_lines(commands, limit) + payloads, payload_lines(head, late, limit)[0] if late else []


def _commands(pid: int, path: str, phase: Phase) -> list[str]:
    return [
        *(on_process(pid, f"set map {path} {k} {v}") for k, v in phase.sets),
        *(on_process(pid, f"del map {path} {k}") for k in phase.dels),
    ]


def payload_lines(head: str, groups: Iterable[str], limit: int) -> tuple[list[str], list[str]]:
    """`head` (an `add map ... <<` command and its newline) followed by `key value` lines, as
    few lines as fit in `limit`, and the entries held back for later.

    A group (one backend's entries, its count last when it is new) that fits in one line
    stays in one. One too long is split, and its count held back: lines run in parallel.
    """
    lines: list[str] = []
    late: list[str] = []
    chunk: list[str] = []
    size = len(head)
    for group in groups:
        if chunk and size + len(group) > limit and len(head) + len(group) <= limit:
            lines.append(head + "".join(chunk))
            chunk, size = [], len(head)
        if size + len(group) <= limit:
            chunk.append(group)
            size += len(group)
            continue
        entries = group.splitlines(keepends=True)
        if is_count_key(entries[-1].partition(" ")[0]):
            late.append(entries.pop())
        for entry in entries:
            if chunk and size + len(entry) > limit:
                lines.append(head + "".join(chunk))
                chunk, size = [], len(head)
            chunk.append(entry)
            size += len(entry)
    if chunk:
        # The line ends with the payload; the client's final newline is the empty line that ends it.
        lines.append(head + "".join(chunk))
    return lines, late


def delta_lines(
    pid: int,
    map_path: str,
    deltas: Sequence[BackendDelta],
    limit: int = DEFAULT_LINE_LIMIT,
    phases: range = PHASES,
) -> list[list[str]]:
    """The CLI lines of several backends' deltas for one worker: one list per non-empty rank,
    sent rank after rank (the lines of one rank may go in parallel). `phases`: only those."""
    path = _map_path(map_path)
    head = on_process(pid, f"add map {path} <<\n")
    ranks: list[list[str]] = []
    for rank in phases:
        commands = [c for d in deltas if rank in d.single_phases for c in _commands(pid, path, d.phases[rank])]
        groups = [group for delta in deltas for group in delta.payloads[rank]]
        ranks += [lines for lines in _rank_lines(head, commands, groups, limit) if lines]
    return ranks


def answer_problem(line: str, answer: str) -> str | None:
    """What is wrong with the answer to one of our map-changing lines, or None. Each command
    that succeeds answers an empty line; fewer means the master dropped the connection
    part-way (re-executing on a reload, for one)."""
    if answer.strip():
        return answer.strip().splitlines()[0]
    commands = line.split("\n", 1)[0].count(";") + 1
    if answer.count("\n") < commands:
        return f"no answer to {commands - answer.count(chr(10))} of {commands} commands (connection dropped)"
    return None


def is_whole_answer(show_map_answer: str) -> bool:
    """A `show map` answer ends with a blank line ("\n" alone for an empty map); a cut one does not."""
    return show_map_answer == "\n" or show_map_answer.endswith("\n\n")


def map_entries(show_map_answer: str) -> dict[str, str]:
    """A key held twice with different values reads as "" so that a diff rewrites it (`set
    map` sets every entry of a key)."""
    entries: dict[str, str] = {}
    for key, value in parse_show_map(show_map_answer):
        if key in entries and entries[key] != value:
            entries[key] = ""
        else:
            entries.setdefault(key, value)
    return entries
