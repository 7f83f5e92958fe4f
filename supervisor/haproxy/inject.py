"""Injections: what the supervisor adds to the rendered config to make the effective one.

Each injection is a pure function Config -> Config that leaves the input alone.
With every injection switched off the effective config is byte-identical to
the rendered one.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .config import (
    PROXY_KINDS,
    Config,
    Line,
    RecentlyUsed,
    Section,
    Server,
    ServerFlags,
    parse_line,
    quote_word,
    server_line_flags,
    template_names,
)


def observe_directive(error_limit: int) -> str:
    return f"observe layer4 error-limit {error_limit} on-error mark-down"


def wants_observe(server: Server | ServerFlags) -> bool:
    """Primary servers with health checks, not already observed.

    `observe` without `check` silently does nothing, and on a `track` server
    `check` is a fatal config error, so neither gets it; backups are the
    fallback the mark-down exists to reach, so they never get marked down.
    """
    return server.check and not server.backup and server.track is None and not server.observe


def inject_observe(config: Config, error_limit: int) -> Config:
    """Add `observe layer4 ... on-error mark-down` to every server line that wants it."""
    result = config.copy()
    suffix = " " + observe_directive(error_limit)
    # Per line, not per server: a server-template line declares many servers with the same flags.
    for section, server_lines in result.server_flags_by_backend():
        for index, flags in server_lines:
            if wants_observe(flags):
                section.body[index] = section.body[index].with_appended(suffix)
    return result


def _append_line(section: Section, words: str) -> None:
    """Add a line after the section's last code line, indented and ended like its neighbours."""
    code = [i for i, line in enumerate(section.body) if line.words]
    neighbour: Line | None = section.body[code[-1]] if code else section.header
    indent = (neighbour.indent if code and neighbour is not None else "") or "    "
    ended = [line for line in (neighbour, section.header) if line is not None and line.raw.endswith("\n")]
    ending = "\r\n" if ended and ended[0].raw.endswith("\r\n") else "\n"
    if neighbour is not None and not neighbour.raw.endswith("\n"):
        # The last line of a file without a final newline must not swallow the new one.
        fixed = parse_line(neighbour.raw + ending)
        if code:
            section.body[code[-1]] = fixed
        else:
            section.header = fixed
    section.body.insert(code[-1] + 1 if code else 0, parse_line(f"{indent}{words}{ending}"))


def inject_server_state(config: Config, path: Path) -> Config:
    """Make the worker load the server state saved before a reload, unless the config already does.

    `server-state-file <path>` goes into global, `load-server-state-from-file global`
    into every defaults section (and into backends that have no defaults to inherit
    from). Each is left out when the rendered config already uses that keyword:
    then it manages server state itself.
    """
    result = config.copy()
    if result.global_setting("server-state-file") is None:
        global_section = next((s for s in result.sections if s.kind == "global"), None)
        if global_section is None:
            global_section = Section(parse_line("global\n"))
            result.sections.insert(1, global_section)
        _append_line(global_section, f"server-state-file {quote_word(str(path))}")
    already_loads = any(
        line.keyword == "load-server-state-from-file"
        for section in result.sections
        if section.kind in PROXY_KINDS
        for line in section.body
    )
    if not already_loads:
        # One pass: a backend inherits from some defaults once any defaults section preceded it
        # (or it names one with `from`); only those that do not need the line of their own.
        seen_defaults = False
        for section in result.sections:
            seen_defaults = seen_defaults or section.kind == "defaults"
            if section.kind == "defaults" or (
                section.kind in ("backend", "listen") and not seen_defaults and section.from_defaults is None
            ):
                _append_line(section, "load-server-state-from-file global")
    return result


# ---------------------------------------------------------------- global keywords


class RefusedGlobal(ValueError):
    """The rendered config's global section holds a keyword the daemon cannot supervise. One line."""


# Global keywords that conflict with being supervised, and why. The daemon starts HAProxy as
# its own child, `haproxy -W -S <master.sock> -f <effective> -p <pid file>`, in the foreground.
# Dropped: the keyword only fights the daemon for the master; without it HAProxy runs as the
# rendered config means it to. Each drop is logged at every build.
DROPPED_GLOBALS = {
    "daemon": "the supervisor runs the HAProxy master in the foreground as its own child; "
    "with `daemon` the master would fork away and run unsupervised",
    "pidfile": "the supervisor passes its own pid file with -p, which overrides this one (HAProxy "
    "never writes it); a controller must not signal HAProxy itself",
}
# `master-worker` alone only says what -W already says, and 3.3+ deprecates it (a warning at
# every check; 3.5 removes it); with `no-exit-on-failure` it would decide what a crashed
# worker does, which is the supervisor's decision.
MASTER_WORKER_WHY = (
    "the supervisor starts HAProxy with -W, which says the same; HAProxy 3.3 deprecates the keyword "
    "and 3.5 removes it"
)
NO_EXIT_ON_FAILURE = "no-exit-on-failure"
NO_EXIT_ON_FAILURE_WHY = (
    "what a crashed worker does is the supervisor's decision, not the rendered config's "
    "(HAProxy's default: the master exits and the supervisor restarts it)"
)
# Refused: no edit makes the config mean what its author meant under the supervisor.
REFUSED_GLOBALS = {
    "nbproc": "multi-process mode was removed in HAProxy 2.5 (threads replace it); "
    "the supervisor tracks one worker per config",
}


def supervised_global(config: Config, master_socket: Path) -> tuple[Config, list[str]]:
    """The rendered config without the global lines that conflict with being supervised, and a
    line saying so for each one dropped; RefusedGlobal for a line that cannot be supervised.

    Lines are named by their line number in the rendered config.
    """
    number = 0
    dropped: list[tuple[int, Line]] = []  # (index of the section, the line)
    notes: list[str] = []
    for index, section in enumerate(config.sections):
        if section.header is not None:
            number += 1
        if section.kind != "global":
            number += len(section.body)
            continue
        for line in section.body:
            number += 1
            words = line.words
            keyword = words[0] if words else ""
            if keyword in REFUSED_GLOBALS:
                raise RefusedGlobal(f"line {number}: global `{keyword}` refused: {REFUSED_GLOBALS[keyword]}")
            if keyword == "stats" and words[1:2] == ("socket",) and len(words) > 2:
                path = words[2].removeprefix("unix@")
                if Path(path) == master_socket:
                    raise RefusedGlobal(
                        f"line {number}: `stats socket {words[2]}` refused: it is the supervisor's master socket"
                    )
            why = DROPPED_GLOBALS.get(keyword)
            if why is None and keyword == "master-worker":
                why = NO_EXIT_ON_FAILURE_WHY if NO_EXIT_ON_FAILURE in words[1:] else MASTER_WORKER_WHY
            if why is not None:
                dropped.append((index, line))
                notes.append(f"line {number}: global `{' '.join(words)}` dropped from the effective config: {why}")
    if not dropped:
        return config, notes
    result = config.copy()
    for index, line in dropped:
        edited = result.sections[index]
        edited.body = [kept for kept in edited.body if kept is not line]
    return result, notes


def first_stats_socket(config: Config) -> tuple[str, ...] | None:
    """The words of the first global `stats socket` line that names an address."""
    for section in config.sections:
        if section.kind == "global":
            for line in section.body:
                if line.keyword == "stats" and line.words[1:2] == ("socket",) and len(line.words) > 2:
                    return line.words
    return None


def move_stats_socket(config: Config, path: Path) -> tuple[Config, str | None]:
    """The config with its first global `stats socket` bound at `path` instead, its other words
    kept (mode, level, expose-fd ...), and the address it had (None: no stats socket, the config
    is returned as it is). A bridge that stands in for HAProxy (haproxy-supervisor-ray-bridge)
    binds the old address itself and relays to `path`."""
    for index, section in enumerate(config.sections):
        if section.kind != "global":
            continue
        for position, line in enumerate(section.body):
            words = line.words
            if line.keyword == "stats" and words[1:2] == ("socket",) and len(words) > 2:
                moved = " ".join(["stats", "socket", quote_word(str(path)), *map(quote_word, words[3:])])
                result = config.copy()
                body = result.sections[index].body
                # What follows the last word (a comment, the line ending) stays as it was.
                body[position] = parse_line(f"{line.indent}{moved}{line.raw[line.code_end :]}")
                return result, words[2]
    return config, None


# ---------------------------------------------------------------- displaced-worker guard

GUARD_MARKER = "# haproxy-supervisor guard"
# Two maps drive the guard. The slot table (a file per config, written by the supervisor,
# never changed at runtime) holds `<backend>_<i>` -> the backend's i-th primary server, in
# config order. The steer map (empty on disk, filled in old workers only) holds
# `<backend>_n`: how many slots a steered backend's requests pick from (0: fail fast), and
# `<backend>_<i>` overrides for the slots whose table server must not be used. A backend
# name cannot end in `_<digits>` or `_n` and also be another backend's key, because a key
# splits uniquely at its last `_`: the suffix is `n` or digits and never contains `_`.
# While a push is under way the steer map may also hold `<backend>/<server>` hops: the
# server a slot resolves to is replaced once more, by the hop's. A hop is added (in a
# payload, with the new entries) when a drain kills a server that overrides point to, so
# requests leave it before those overrides are changed one `set map` command at a time;
# the same push removes it. `/` is in no backend or server name.
COUNT_SUFFIX = "n"
HOP_SEPARATOR = "/"
SLOT_TABLE_PREFIX = "slots-"
# Variables live in the txn scope; the prefix keeps them away from the rendered config's own.
_VARS = ("txn.hsv_n", "txn.hsv_slot", "txn.hsv_srv", "txn.hsv_hop")
# A map path goes inside a converter argument, where `,`, `)`, blanks and quotes would break it.
_SAFE_MAP_PATH = re.compile(r"^/[A-Za-z0-9_./-]+$")


def guard_rules(mode: str, map_path: str, slot_table_path: str) -> list[str]:
    """The request rules (without indentation) that let a map steer one backend.

    With the steer map empty the backend routes as its config says. With `<be>_n` = N > 0,
    each request picks a random slot below N; the steer map's entry for that slot, if any,
    else the slot table's, names the server the `use-server` rule sends it to, ahead of the
    backend's own `use-server` rules and its balancing. With N = 0 the request is answered
    with a 503 (HTTP) or its connection closed (TCP) at once. A `<be>/<server>` entry for
    the server so chosen replaces it (a hop, see above). The target and hop variables are
    unset first: a `listen` section that switches to another guarded backend would
    otherwise carry them over.
    """
    for path in (map_path, slot_table_path):
        if not _SAFE_MAP_PATH.match(path):
            raise ValueError(f"map path {path!r}: only letters, digits and _ . / - can go into a map() argument")
    rule = "http-request" if mode == "http" else "tcp-request content"
    refuse = "return status 503" if mode == "http" else "reject"
    n, slot, srv, hop = _VARS
    steered = f"{{ var({n}) -m int gt 0 }}"
    unset = f"!{{ var({srv}) -m found }}"
    return [
        f"{rule} unset-var({srv})",
        f"{rule} unset-var({hop})",
        f"{rule} set-var({n}) be_name,concat(_{COUNT_SUFFIX}),map({map_path},-1)",
        f"{rule} {refuse} if {{ var({n}) -m int 0 }}",
        f"{rule} set-var({slot}) rand,mod({n}) if {steered}",
        f"{rule} set-var({srv}) be_name,concat(_,{slot}),map({map_path}) if {steered}",
        f"{rule} set-var({srv}) be_name,concat(_,{slot}),map({slot_table_path}) if {steered} {unset}",
        f"{rule} set-var({hop}) be_name,concat({HOP_SEPARATOR},{srv}),map({map_path}) if {steered}",
        f"{rule} set-var({srv}) var({hop}) if {{ var({hop}) -m found }}",
    ]


def guard_use_server() -> str:
    return f"use-server %[var({_VARS[2]})] if {{ var({_VARS[2]}) -m found }}"


def guard_block(mode: str, map_path: str, slot_table_path: str) -> list[str]:
    """The whole block as it reads when nothing else sits between its rules and its `use-server`."""
    return [GUARD_MARKER, *guard_rules(mode, map_path, slot_table_path), guard_use_server()]


# The order HAProxy evaluates a proxy's request rules in. It warns about a rule written
# after one of a later rank ("will still be processed before"), so the guard's lines go
# where they are both first of their rank and free of that warning.
_RULE_RANK = {"tcp-request": 0, "http-request": 1, "redirect": 2, "use_backend": 3, "use-server": 4}


def _rank(line: Line) -> int | None:
    if line.keyword == "tcp-request":
        return 0 if len(line.words) > 1 and line.words[1] == "content" else None
    return _RULE_RANK.get(line.keyword)


def inject_guard(config: Config, map_path: str | Path, slot_table_path: str | Path) -> Config:
    """Put the guard's rules first among the request rules of every backend and listen that
    has primary servers, and its `use-server` first among the `use-server` rules.

    `slot_table_path` names the file that holds slot_table_text(slot_table(config)).
    """
    return _inject_guard(config, map_path, table_path=Path(slot_table_path))[0]


def inject_guard_and_table(config: Config, map_path: str | Path, directory: Path) -> tuple[Config, SlotTable]:
    """inject_guard() naming SlotTable.of(config, directory), and that table: the servers are
    looked at once for both (10,000 of them, on every reload)."""
    return _inject_guard(config, map_path, directory=directory)


@dataclass(frozen=True, slots=True)
class _GuardPlan:
    """What the guard needs from one backend body: its slot-table row, and where the block
    goes. It depends on the body's text, its mode and its defaults' `default-server` flags
    only, so it is worked out once and reused by the next builds: a drain changes a few
    backends of a thousand."""

    names: tuple[str, ...]  # the primaries, in slot order
    at: int | None  # where the rules go; None: no guard (no primary, or guarded already)
    use_at: int  # where the `use-server` goes
    indent: str


# (defaults' flags, mode, body text) -> its plan: nothing else goes into it, so an edited
# line gives another key, never a stale plan.
_GUARD_PLANS: RecentlyUsed[tuple[ServerFlags, str, str], _GuardPlan] = RecentlyUsed()


def _guard_plan(body: list[Line], defaults_flags: ServerFlags, mode: str) -> _GuardPlan:
    names = primary_names(body, server_line_flags(body, defaults_flags))
    indent = next((line.indent for line in body if line.words), "") or "    "
    if not names or _has_marker(body):
        return _GuardPlan(tuple(names), None, 0, indent)
    own_rank = _RULE_RANK["tcp-request" if mode != "http" else "http-request"]
    # Most lines are no request rule at all: look at their first word before ranking them.
    ranks = {
        i: rank
        for i, line in enumerate(body)
        if line.words and line.words[0] in _RULE_RANK and (rank := _rank(line)) is not None
    }
    ranked = list(ranks)
    at = next((i for i in ranked if ranks[i] >= own_rank), ranked[-1] + 1 if ranked else 0)
    first_use_server = next((i for i in ranked if ranks[i] == _RULE_RANK["use-server"]), None)
    if first_use_server is None:
        later = [i for i in ranked if i >= at]
        use_at = (later[-1] + 1) if later else at
    else:
        use_at = first_use_server
    return _GuardPlan(tuple(names), _above_comments(body, at), _above_comments(body, use_at), indent)


def _inject_guard(
    config: Config, map_path: str | Path, *, table_path: Path | None = None, directory: Path | None = None
) -> tuple[Config, SlotTable]:
    """With `directory`, the table is made from the config and named; with `table_path`, that
    path is named, and the table returned stands for it without its text."""
    _GUARD_PLANS.new_generation()
    result = config.copy()
    plans: list[tuple[Section, str, _GuardPlan]] = []
    for section, settings in result.backends_with_settings():
        mode, flags = settings.mode, settings.server_defaults
        key = (flags, mode, "".join([line.raw for line in section.body]))
        plan = _GUARD_PLANS.get(key)
        if plan is None:
            plan = _guard_plan(section.body, flags, mode)
            _GUARD_PLANS.put(key, plan)
        plans.append((section, mode, plan))
    if table_path is not None:
        table = SlotTable(table_path, "")
    else:
        assert directory is not None
        table = SlotTable.of_rows([(s.name, list(plan.names)) for s, _, plan in plans if plan.names], directory)
    map_text, table_text = str(map_path), str(table.path)
    # The guard's lines differ only by mode, indentation and line ending: parse them once
    # for the 1,000 backends that share those (Lines are immutable, so they can be shared).
    blocks: dict[tuple[str, str, str], tuple[list[Line], list[Line], list[Line]]] = {}
    for section, mode, plan in plans:
        at = plan.at
        if at is None:
            continue
        indent = plan.indent
        newline = "\r\n" if section.header is not None and section.header.raw.endswith("\r\n") else "\n"
        if section.header is not None and not section.header.raw.endswith("\n"):
            # A header on the file's last line, without a newline: give it one before the block.
            section.header = parse_line(section.header.raw + newline)
        block = blocks.get((mode, indent, newline))
        if block is None:

            def lines(texts: list[str], newline: str = newline, indent: str = indent) -> list[Line]:
                return [parse_line(f"{indent}{text}{newline}") for text in texts]

            block = blocks[(mode, indent, newline)] = (
                lines([GUARD_MARKER, *guard_rules(mode, map_text, table_text)]),
                lines([guard_use_server()]),
                lines([GUARD_MARKER, guard_use_server()]),
            )
        rules, use_server_alone, use_server_marked = block
        use_at, body = plan.use_at, section.body
        use_server = use_server_alone if use_at == at else use_server_marked
        section.body = [*body[:at], *rules, *body[at:use_at], *use_server, *body[use_at:]]
    return result, table


def _above_comments(body: list[Line], index: int) -> int:
    """Move an insertion point above the comment lines that introduce the line it precedes."""
    while index > 0 and not body[index - 1].words and body[index - 1].raw.strip().startswith("#"):
        index -= 1
    return index


def is_guarded(section: Section) -> bool:
    return _has_marker(section.body)


def _has_marker(body: list[Line]) -> bool:
    # The marker is a comment: a line with words cannot be it, and words are cheaper to look at.
    return any(not line.words and _is_marker(line) for line in body)


def _is_marker(line: Line) -> bool:
    return line.raw.strip() == GUARD_MARKER


def guarded_backends(config: Config) -> frozenset[str]:
    """Names of the backends whose guard block a steer map can drive."""
    return frozenset(s.name for s in config.backends() if is_guarded(s))


# ---------------------------------------------------------------- the slot table


def slot_table(config: Config) -> list[tuple[str, list[str]]]:
    """Each backend and listen with primary servers (the ones the guard goes into), with the
    names of its primaries in config order: slot i of the backend is the i-th name.

    Every primary has its slot, disabled, weight 0 and down ones included: the table then
    depends only on which servers exist, so a runtime apply of in-place changes leaves a
    worker's table equal to the one its new config names; one that adds or removes servers
    brings the worker's loaded table to the new rows with map commands (runtime/add_remove.py). The
    steer map overrides the slots that must not be used.
    """
    return _slot_rows(config.server_flags_by_backend())


def _slot_rows(flagged: list[tuple[Section, list[tuple[int, ServerFlags]]]]) -> list[tuple[str, list[str]]]:
    rows = [(section.name, primary_names(section.body, server_lines)) for section, server_lines in flagged]
    return [(name, names) for name, names in rows if names]


def primary_names(body: list[Line], server_lines: list[tuple[int, ServerFlags]]) -> list[str]:
    """The names of a backend's primary servers in config order, templates expanded: slot i
    is the i-th. `server_lines`: Config.server_flags_by_backend()'s list for this body."""
    names: list[str] = []
    for index, flags in server_lines:
        if not flags.backup:
            words = body[index].words
            names.extend([words[1]] if words[0] == "server" else template_names(words[1], words[2]))
    return names


def slot_table_text(table: list[tuple[str, list[str]]]) -> str:
    """The slot table as an HAProxy map file: `<backend>_<i> <server>` per line."""
    return "".join(f"{backend}_{i} {name}\n" for backend, names in table for i, name in enumerate(names))


@dataclass(frozen=True)
class SlotTable:
    """A slot table file: content-addressed, so a config never names a table that another
    config rewrote (a reload that failed, a master restarted on an older config)."""

    path: Path
    text: str

    @classmethod
    def of(cls, config: Config, directory: Path) -> SlotTable:
        return cls.of_rows(slot_table(config), directory)

    @classmethod
    def of_rows(cls, rows: list[tuple[str, list[str]]], directory: Path) -> SlotTable:
        text = slot_table_text(rows)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return cls(directory / f"{SLOT_TABLE_PREFIX}{digest}.map", text)
