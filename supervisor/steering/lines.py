"""Wire: one worker's phased map changes as lines for the master CLI, and its answers read.

New entries travel as `add map` payloads (a few bytes per entry, parsed by HAProxy in one
go), everything else as `set map` / `del map` commands joined with `;` on lines that fit the
CLI's buffer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..haproxy.answers import parse_show_map
from ..haproxy.api import DEFAULT_LINE_LIMIT, batch_lines, on_process
from ..haproxy.guard import backend_of_key, is_count_key
from .mapdiff import PHASES, BackendDelta, Phase

_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./-]+$")


def _map_path(map_path: str) -> str:
    if not _SAFE_PATH.match(map_path):
        raise ValueError(f"invalid map path {map_path!r}")
    return map_path


def phase_lines(
    pid: int, map_path: str, phase: Phase, limit: int = DEFAULT_LINE_LIMIT, version: int | None = None
) -> list[str]:
    """Lines for the master CLI: sets and deletes joined with `;`, adds as `add map` payloads.

    A payload (`add map <file> <<` then one `key value` per line) costs a few bytes per
    entry where a command costs ~60, and HAProxy parses it in one go: it is what makes
    pushing thousands of entries to dozens of workers fast. Each line fits in `limit`.
    `version`: add to that version of the map (from `prepare map`), to be committed.
    """
    path = _map_path(map_path)
    individual = [
        *(on_process(pid, f"set map {path} {k} {v}") for k, v in phase.sets),
        *(on_process(pid, f"del map {path} {k}") for k in phase.dels),
    ]
    lines = batch_lines(individual, limit) if individual else []
    at_version = f"@{int(version)} " if version is not None else ""
    head = on_process(pid, f"add map {at_version}{path} <<\n")
    groups: dict[str, list[str]] = {}
    for key, value in phase.adds:
        groups.setdefault(backend_of_key(key), []).append(f"{key} {value}\n")
    if groups:
        payloads, late = payload_lines(head, ("".join(group) for group in groups.values()), limit)
        lines += payloads
        if late:
            lines += payload_lines(head, late, limit)[0]  # callers that need them later use delta_lines
    return lines


def payload_lines(head: str, groups: Iterable[str], limit: int) -> tuple[list[str], list[str]]:
    """`head` (an `add map ... <<` command and its newline) followed by `key value` lines, as
    few lines as fit in `limit`, and the entries held back for later.

    Each group (one backend's entries, its count last when it is new) stays in one line when
    it fits in one, so the count arrives with its slots. A group too long for one line is
    split, and its count is held back: lines run in parallel, so it may only be sent once
    the lines with its slots were answered.
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
    to be sent rank after rank (the lines of one rank may go in parallel). `phases`: only
    those of diff_phases()."""
    path = _map_path(map_path)
    head = on_process(pid, f"add map {path} <<\n")
    ranks: list[list[str]] = []
    for rank in phases:
        individual: list[str] = []
        for delta in deltas:
            if rank in delta.single_phases:
                phase = delta.phases[rank]
                individual += [on_process(pid, f"set map {path} {k} {v}") for k, v in phase.sets]
                individual += [on_process(pid, f"del map {path} {k}") for k in phase.dels]
        lines = batch_lines(individual, limit) if individual else []
        late: list[str] = []
        groups = [group for delta in deltas for group in delta.payloads[rank]]
        if groups:
            payloads, late = payload_lines(head, groups, limit)
            lines += payloads
        if lines:
            ranks.append(lines)
        if late:
            ranks.append(payload_lines(head, late, limit)[0])
    return ranks


def answer_problem(line: str, answer: str) -> str | None:
    """What is wrong with the master CLI's answer to one of our map-changing lines, or None.

    Each command that succeeds answers an empty line and nothing else. Fewer empty lines
    than commands means the master dropped the connection part-way (while re-executing on
    a reload, for one): those commands may not have run, so it is not a success.
    """
    if answer.strip():
        return answer.strip().splitlines()[0]
    commands = line.split("\n", 1)[0].count(";") + 1
    if answer.count("\n") < commands:
        return f"no answer to {commands - answer.count(chr(10))} of {commands} commands (connection dropped)"
    return None


def is_whole_answer(show_map_answer: str) -> bool:
    """A `show map` answer ends with a blank line: "\n" alone for an empty map, else the
    last entry's newline and one more. A connection dropped mid-answer ends otherwise."""
    return show_map_answer == "\n" or show_map_answer.endswith("\n\n")


def map_entries(show_map_answer: str) -> dict[str, str]:
    """A map's content from `show map <file>`. A key held twice with different values reads
    as "" so that a diff rewrites it (`set map` sets every entry of a key)."""
    entries: dict[str, str] = {}
    for key, value in parse_show_map(show_map_answer):
        if key in entries and entries[key] != value:
            entries[key] = ""
        else:
            entries.setdefault(key, value)
    return entries
