"""The displaced-worker guard: the rules injected into every backend with primary servers, the
slot table they read, and the steer map's key format (docs/steering.md)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .config import Config, Section
from .lexer import Line, Slot, body_key, parse_line
from .resolution import ProxySettings, ServerFlags, server_line_flags, template_names
from .routing import BUCKET_BITS, PLAIN, Routing, routing_of, server_ids

GUARD_MARKER = "# haproxy-supervisor guard"
# The slot table (a file per config): `<backend>_<i>` -> the i-th primary. The steer map (filled
# in old workers only): `<backend>_n`, how many slots to draw from (0: fail fast), `<backend>_<i>`
# overrides, and during a push `<backend>/<server>` hops (`/` is in no name). A key splits
# uniquely at its last `_`.
COUNT_SUFFIX = "n"
HOP_SEPARATOR = "/"
SLOT_TABLE_PREFIX = "slots-"
# What routing.py reproduces: in the slot table `<backend>/c<cookie>` and `<backend>/s<id>` -> a
# primary's home slot; in the steer map `<backend>_t`, a hash's modulus (or buckets), and
# `<backend>_h<i>`, the server for position i.
COOKIE_ROW = "/c"
STICK_ROW = "/s"
TOTAL_SUFFIX = "t"
HASH_PREFIX = "h"
# Variables live in the txn scope; the prefix keeps them away from the rendered config's own.
_VARS = ("txn.hsv_n", "txn.hsv_slot", "txn.hsv_srv", "txn.hsv_hop")
_CK, _SID, _T, _KEY, _H = "txn.hsv_ck", "txn.hsv_sid", "txn.hsv_t", "txn.hsv_key", "txn.hsv_h"
# A map path goes inside a converter argument, where `,`, `)`, blanks and quotes would break it.
_SAFE_MAP_PATH = re.compile(r"^/[A-Za-z0-9_./-]+$")


def guard_rules(mode: str, map_path: str, slot_table_path: str, routing: Routing = PLAIN) -> list[str]:
    """The request rules that let a map steer one backend (docs/steering.md); with the steer map
    empty it routes as its config says. Variables are unset first: a `listen` section that
    switches to another guarded backend would carry them over."""
    for path in (map_path, slot_table_path):
        if not _SAFE_MAP_PATH.match(path):
            raise ValueError(f"map path {path!r}: only letters, digits and _ . / - can go into a map() argument")
    rule = "http-request" if mode == "http" else "tcp-request content"
    refuse = "return status 503" if mode == "http" else "reject"
    n, slot, srv, hop = _VARS
    steered = f"{{ var({n}) -m int gt 0 }}"
    unset = f"!{{ var({srv}) -m found }}"
    no_slot = f"!{{ var({slot}) -m found }}"
    has_slot = f"{{ var({slot}) -m found }}"
    overridden = f"{{ be_name,concat(_,{slot}),map({map_path}) -m found }}"
    in_table = f"{{ be_name,concat(_,{slot}),map({slot_table_path}) -m found }}"
    persisted = [*([_CK] if routing.cookie else []), *([_SID] if routing.sticks else [])]
    persisted += [_T, _KEY, _H] if routing.hashed else []
    # A plain backend's slot is always drawn (a `listen` section's is overwritten): no unset.
    rules = [f"{rule} unset-var({var})" for var in (srv, hop, *([slot] if persisted else []), *persisted)]
    rules += [
        f"{rule} set-var({n}) be_name,concat(_{COUNT_SUFFIX}),map({map_path},-1)",
        f"{rule} {refuse} if {{ var({n}) -m int 0 }}",
    ]
    # The home slot of the server a cookie or a stick entry names, if the steer map leaves it.
    drop_overridden = f"{rule} unset-var({slot}) if {has_slot} {overridden}"
    cookie_found, sid_found = f"{{ var({_CK}) -m found }}", f"{{ var({_SID}) -m found }}"
    key_given = f"{{ var({_KEY}) -m found }} !{{ var({_KEY}) -m len 0 }}"
    if routing.cookie:
        rules += [
            f"{rule} set-var({_CK}) {routing.cookie} if {steered}",
            f"{rule} set-var({slot}) be_name,concat({COOKIE_ROW},{_CK}),map({slot_table_path}) if {cookie_found}",
            drop_overridden,
        ]
    for stick in routing.sticks:
        rules += [
            f"{rule} set-var({_SID}) {stick} if {steered} {no_slot}",
            f"{rule} set-var({slot}) be_name,concat({STICK_ROW},{_SID}),map({slot_table_path})"
            f" if {no_slot} {sid_found}",
            drop_overridden,
        ]
    drawn = no_slot if persisted else ""
    if routing.hash_key:
        hashing = f",{routing.hash_function}" if routing.hash_function else ""
        # A map-based hash's position in the server map, or a consistent hash's bucket.
        position = f"div({1 << (32 - BUCKET_BITS)})" if routing.consistent else f"mod({_T})"
        rules += [
            f"{rule} set-var({_T}) be_name,concat(_{TOTAL_SUFFIX}),map({map_path},0) if {steered} {no_slot}",
            f"{rule} set-var({_KEY}) {routing.hash_key} if {{ var({_T}) -m int gt 0 }}",
            f"{rule} set-var({_H}) var({_KEY}){hashing},{position} if {key_given}",
            f"{rule} set-var({srv}) be_name,concat(_{HASH_PREFIX},{_H}),map({map_path}) if {{ var({_H}) -m found }}",
        ]
        drawn = f"{no_slot} !{{ var({_H}) -m found }}"
    return [
        *rules,
        f"{rule} set-var({slot}) rand,mod({n}) if {steered} {drawn}".rstrip(),
        f"{rule} set-var({slot}) rand,mod({n}) if {has_slot} {overridden} {in_table}",
        f"{rule} set-var({slot}) rand,mod({n}) if {has_slot} {overridden} {in_table}",
        f"{rule} set-var({srv}) be_name,concat(_,{slot}),map({map_path}) if {has_slot}",
        f"{rule} set-var({srv}) be_name,concat(_,{slot}),map({slot_table_path}) if {has_slot} {unset}",
        f"{rule} set-var({hop}) be_name,concat({HOP_SEPARATOR},{srv}),map({map_path}) if {steered}",
        f"{rule} set-var({srv}) var({hop}) if {{ var({hop}) -m found }}",
    ]


# No request rule runs at a retry: a `use-server` request stays on its dead target unless every
# retry is redispatched (docs/steering.md, "A retry in an old worker").
GUARD_REDISPATCH = "option redispatch 1"


def guard_redispatch(settings: ProxySettings) -> tuple[str, ...]:
    """`option redispatch 1`, unless the backend or its defaults say how retries are redispatched."""
    return () if settings.redispatch_said else (GUARD_REDISPATCH,)


def guard_use_server() -> str:
    return f"use-server %[var({_VARS[2]})] if {{ var({_VARS[2]}) -m found }}"


# HAProxy warns of a request rule written after one of a later rank: the guard's go first of theirs.
_RULE_RANK = {"tcp-request": 0, "http-request": 1, "redirect": 2, "use_backend": 3, "use-server": 4}


def _rank(line: Line) -> int | None:
    if line.keyword == "tcp-request":
        return 0 if len(line.words) > 1 and line.words[1] == "content" else None
    return _RULE_RANK.get(line.keyword)


@dataclass(frozen=True, slots=True)
class GuardPlan:
    """What the guard needs from one backend body, worked out once per body and settings."""

    names: tuple[str, ...]  # the primaries, in slot order
    rows: tuple[tuple[str, str], ...]  # the slot table's persistence rows: (key suffix, home slot)
    routing: Routing
    at: int | None  # where the rules go; None: no guard (no primary, or guarded already)
    use_at: int  # where the `use-server` goes
    indent: str
    slot_lines: str  # its rows of slot_table_text(), made once with the plan
    redispatch: tuple[str, ...] = ()  # guard_redispatch()'s line, if it goes in


# (what applies to a backend, its name, its body's key) -> where the guard goes in it.
GUARD_PLANS: Slot[tuple[ProxySettings, str, bytes], GuardPlan] = Slot("guard plans")


def _guard_plan(body: list[Line], settings: ProxySettings, backend: str) -> GuardPlan:
    mode = settings.mode
    server_lines = server_line_flags(body, settings.server_defaults)
    names = primary_names(body, server_lines)
    indent = next((line.indent for line in body if line.words), "") or "    "
    routing = routing_of(settings, body, backend) if names else PLAIN
    rows = _persistence_rows(body, server_lines, routing)
    slots = slot_table_text([(backend, names)])
    if not names or _has_marker(body):
        return GuardPlan(tuple(names), rows, routing, None, 0, indent, slots)
    own_rank = _RULE_RANK["tcp-request" if mode != "http" else "http-request"]
    # Most lines are no request rule at all: look at their first word before ranking them.
    ranks = {
        i: rank
        for i, line in enumerate(body)
        if line.words and line.words[0] in _RULE_RANK and (rank := _rank(line)) is not None
    }
    ranked = list(ranks)
    at = next((i for i in ranked if ranks[i] >= own_rank), ranked[-1] + 1 if ranked else 0)
    # Before the first `use-server`, else after the last rule from `at` on.
    later = [i for i in ranked if i >= at]
    use_at = next((i for i in ranked if ranks[i] == _RULE_RANK["use-server"]), later[-1] + 1 if later else at)
    at, use_at = above_comments(body, at), above_comments(body, use_at)
    return GuardPlan(tuple(names), rows, routing, at, use_at, indent, slots, guard_redispatch(settings))


def _persistence_rows(
    body: list[Line], server_lines: list[tuple[int, ServerFlags]], routing: Routing
) -> tuple[tuple[str, str], ...]:
    """(key suffix, home slot) for each primary a cookie value or a stick entry can name."""
    if not routing.cookie and not routing.sticks:
        return ()
    servers: list[tuple[str, bool, str | None, tuple[str, ...]]] = []  # name, backup, cookie, params
    for index, flags in server_lines:
        words = body[index].words
        if words[0] == "server":
            servers.append((words[1], flags.backup, flags.cookie, words[3:]))
        else:
            servers += [(name, flags.backup, None, words[4:]) for name in template_names(words[1], words[2])]
    home = {name: i for i, name in enumerate(name for name, backup, _, _ in servers if not backup)}
    rows: list[tuple[str, str]] = []
    if routing.cookie:
        seen: set[str] = set()
        for name, backup, cookie, _ in servers:
            # HAProxy takes the first server whose cookie matches.
            if cookie is not None and cookie not in seen and re.fullmatch(r"[^\s;,]+", cookie):
                seen.add(cookie)
                if not backup:
                    rows.append((f"{COOKIE_ROW}{cookie}", str(home[name])))
    if routing.sticks:
        ids = server_ids([(name, params) for name, _, _, params in servers])
        rows += [(f"{STICK_ROW}{ids[name]}", str(home[name])) for name, backup, _, _ in servers if not backup]
    return tuple(rows)


def inject_guard_and_table(config: Config, map_path: str | Path, directory: Path) -> tuple[Config, SlotTable]:
    """The guard's rules first among the request rules of every backend with primaries, its
    `use-server` first among the `use-server` rules; with the slot table they name."""
    result = config.copy()
    plans = _plans(result)
    table = SlotTable.of_plans(plans, directory)
    map_text, table_text = str(map_path), str(table.path)
    # Parsed once for all the backends that share mode, routing, indentation and line ending.
    blocks: dict[tuple[str, Routing, str, str, tuple[str, ...], bool], tuple[list[Line], list[Line]]] = {}
    for section, mode, plan in plans:
        at, use_at, indent, body = plan.at, plan.use_at, plan.indent, section.body
        if at is None:
            continue
        newline = "\r\n" if section.header is not None and section.header.raw.endswith("\r\n") else "\n"
        if section.header is not None and not section.header.raw.endswith("\n"):
            # A header on the file's last line, without a newline: give it one before the block.
            section.header = parse_line(section.header.raw + newline)
        key = (mode, plan.routing, indent, newline, plan.redispatch, use_at == at)
        if key not in blocks:
            texts = [GUARD_MARKER, *plan.redispatch, *guard_rules(mode, map_text, table_text, plan.routing)]
            use = [guard_use_server()] if use_at == at else [GUARD_MARKER, guard_use_server()]
            made, use_made = ([parse_line(f"{indent}{text}{newline}") for text in lines] for lines in (texts, use))
            blocks[key] = made, use_made
        rules, use_server = blocks[key]
        section.body = [*body[:at], *rules, *body[at:use_at], *use_server, *body[use_at:]]
    return result, table


def _plans(config: Config) -> list[tuple[Section, str, GuardPlan]]:
    kept = config.cache.kept(GUARD_PLANS)
    plans: list[tuple[Section, str, GuardPlan]] = []
    for section, settings in config.each_backend_with_settings():
        key = (settings, section.name, body_key(section.body))
        plan = kept.get_or_make(key, _guard_plan, section.body, settings, section.name)
        plans.append((section, settings.mode, plan))
    return plans


def above_comments(body: list[Line], index: int) -> int:
    """An insertion point moved above the comment lines that introduce the line it precedes."""
    while index > 0 and not body[index - 1].words and body[index - 1].raw.strip().startswith("#"):
        index -= 1
    return index


def is_guarded(section: Section) -> bool:
    return _has_marker(section.body)


def _has_marker(body: list[Line]) -> bool:
    # The marker is a comment: a line with words cannot be it, and words are cheaper to look at.
    return any(not line.words and line.raw.strip() == GUARD_MARKER for line in body)


def slot_table(config: Config) -> list[tuple[str, list[str]]]:
    """Each backend with primaries, their names in config order (slot i is the i-th). Disabled,
    weight 0 and down primaries too: in-place runtime changes leave the table as it is."""
    return [(section.name, list(plan.names)) for section, _, plan in _plans(config) if plan.names]


def primary_names(body: list[Line], server_lines: list[tuple[int, ServerFlags]]) -> list[str]:
    names: list[str] = []
    for index, flags in server_lines:
        if not flags.backup:
            words = body[index].words
            names.extend([words[1]] if words[0] == "server" else template_names(words[1], words[2]))
    return names


def slot_table_text(table: list[tuple[str, list[str]]], rows: list[tuple[str, str]] | None = None) -> str:
    """The slot table as a map file: `<backend>_<i> <server>` lines, then the persistence rows."""
    slots = "".join(f"{backend}_{i} {name}\n" for backend, names in table for i, name in enumerate(names))
    return slots + "".join(f"{key} {value}\n" for key, value in rows or [])


def persistence_rows(config: Config) -> list[tuple[str, str]]:
    """Every guarded backend's persistence rows, as whole map keys and values."""
    return _rows_of(_plans(config))


def _rows_of(plans: list[tuple[Section, str, GuardPlan]]) -> list[tuple[str, str]]:
    return [(f"{s.name}{suffix}", slot) for s, _, plan in plans if plan.names for suffix, slot in plan.rows]


@dataclass(frozen=True)
class SlotTable:
    """A slot table file, content-addressed: a config never names a table another rewrote."""

    path: Path
    text: str

    @classmethod
    def of_plans(cls, plans: list[tuple[Section, str, GuardPlan]], directory: Path) -> SlotTable:
        # slot_table_text() of the plans' rows, from the text each plan keeps of its own.
        text = "".join([plan.slot_lines for _, _, plan in plans]) + slot_table_text([], _rows_of(plans))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return cls(directory / f"{SLOT_TABLE_PREFIX}{digest}.map", text)


def count_key(backend: str) -> str:
    return f"{backend}_{COUNT_SUFFIX}"


def slot_key(backend: str, index: int) -> str:
    return f"{backend}_{index}"


def is_count_key(key: str) -> bool:
    return key.endswith(f"_{COUNT_SUFFIX}")


def hop_key(backend: str, server: str) -> str:
    return f"{backend}{HOP_SEPARATOR}{server}"


def is_hop_key(key: str) -> bool:
    return HOP_SEPARATOR in key


def backend_of_key(key: str) -> str:
    """The backend a map key belongs to: before a hop's `/`, else before the last `_`."""
    backend, hop, _ = key.partition(HOP_SEPARATOR)
    return backend if hop else key.rpartition("_")[0]
