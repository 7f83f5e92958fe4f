"""Displaced (old) workers: which servers each one must stop using, and telling it so.

An old worker serves the connections it still holds with its frozen config: no health
checks run there, and every server-changing runtime command is refused ("Proxy is
disabled."). What does work in it is a map: the guard block injected into every backend
(haproxy/inject.py) consults `<runtime_dir>/steer.map`, which is empty on disk, and steers
the backend's requests as soon as the map holds entries for it. So this module:

- decides, per generation, which servers are known to be dead (pure functions below);
- turns that into the map entries each worker needs (spread over the live primaries, else
  a backup, else fail fast);
- keeps every old worker's map equal to what it needs, through the master CLI (`@!<pid>`),
  and reads it back to verify (DisplacedWorkers, the thin I/O shell at the end).

Map layout (one steer map for all backends, next to each config's slot table, see
haproxy/inject.py): `<backend>_n` = how many slots the backend's requests pick from (`0`:
answer 503 / close at once), `<backend>_<i>` = the server for slot i instead of the slot
table's. A drain that kills one primary of ten costs two entries per backend, not ten.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import operator
import re
import time
import zlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Generic, Literal, TypeVar

import psutil

from .haproxy.api import (
    ADMIN_MAINT_MASK,
    DEFAULT_LINE_LIMIT,
    CLIError,
    MasterCLI,
    ProcList,
    ServerState,
    batch_lines,
    on_process,
    parse_servers_state,
    parse_show_map,
    validate_name,
)
from .haproxy.config import Config, ProxySettings, Section, Server, section_servers
from .haproxy.inject import COUNT_SUFFIX, HOP_SEPARATOR, SLOT_TABLE_PREFIX, is_guarded
from .settings import Settings
from .state import Generation, OldWorker, PushState, State, utcnow

log = logging.getLogger("supervisor.displaced")

NoBackup = Literal["fail-fast", "keep"]
A, B, R = TypeVar("A"), TypeVar("B"), TypeVar("R")
_NO_ENTRIES: Mapping[str, str] = MappingProxyType({})  # a backend with nothing steered: one shared object
_NOTHING: frozenset[str] = frozenset()
FAIL_FAST = "0"  # the value of `<backend>_n` that makes the guard refuse the request

# ================================================================= pure decisions


def endpoint(address: str, port: int | None) -> str:
    return f"{address}:{port}" if port is not None else address


@functools.lru_cache(maxsize=65536)  # a drain digests a hundred new sections; their hosts repeat
def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


# Where a server is: "<backend> <address>:<port>". One string (a backend name has no blank),
# because strings cache their hash and sets of 10,000 of them are compared on every drain.
At = str


def at(backend: str, address: str) -> At:
    return f"{backend} {address}"


@dataclass(frozen=True, eq=False)
class SectionDigest:
    """One backend or listen section's servers, as the decisions need them."""

    name: str
    servers: tuple[Server, ...]
    by_name: dict[str, Server]
    at_keys: dict[At, tuple[str, ...]]  # servers that are not disabled, per (backend, endpoint)
    present: frozenset[At]  # the same, as a set: where this section routes to
    named_hosts: tuple[Server, ...]  # servers given by host name, whose live address differs
    slots: tuple[Server, ...]  # the primaries, slot i is slots[i]: inject.slot_table's order
    guarded: bool
    all_backups: bool  # `option allbackups`

    @classmethod
    def of(cls, servers: list[Server], section: Section, all_backups: bool) -> SectionDigest:
        at_keys: dict[At, list[str]] = {}
        for s in servers:
            if not s.disabled:
                at_keys.setdefault(at(s.backend, s.endpoint), []).append(s.key)
        return cls(
            name=section.name,
            servers=tuple(servers),
            by_name={s.name: s for s in servers},
            at_keys={where: tuple(keys) for where, keys in at_keys.items()},
            present=frozenset(at_keys),
            named_hosts=tuple(s for s in servers if s.port is not None and not _is_ip(s.address)),
            slots=tuple(s for s in servers if not s.backup),
            guarded=is_guarded(section),
            all_backups=all_backups,
        )


_SLOT_TABLE_NAME = re.compile(re.escape(SLOT_TABLE_PREFIX) + r"[0-9a-f]+\.map")


class SectionCache:
    """Section digests by the section's text (and its defaults'): consecutive rendered configs
    differ in a few backends, so a 10,000-server config is digested in milliseconds, and
    generations share their unchanged sections (memory, and identity for quick comparisons)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[ProxySettings, str], SectionDigest] = {}

    def sections_of(self, model: Config) -> dict[str, SectionDigest]:
        result: dict[str, SectionDigest] = {}
        for section, settings in model.backends_with_settings():
            header = section.header.raw if section.header is not None else ""
            text = header + "".join([line.raw for line in section.body])
            # Every reload that moves a replica names a new slot table in every guarded
            # section; the digest does not depend on the name, and must stay shared.
            key = (settings, _SLOT_TABLE_NAME.sub("", text) if SLOT_TABLE_PREFIX in text else text)
            digest = self.entries.get(key)
            if digest is None:
                servers = section_servers(section, settings)
                digest = self.entries[key] = SectionDigest.of(servers, section, settings.all_backups)
            result[section.name] = digest
        return result

    def keep_only(self, digests: Iterable[ConfigDigest]) -> None:
        used = {id(sd) for d in digests for sd in d.sections.values()}
        self.entries = {k: v for k, v in self.entries.items() if id(v) in used}


@dataclass(frozen=True, eq=False)
class ConfigDigest:
    """What the displaced-worker decisions need from one config, worked out once.

    Servers are matched by backend and address (endpoint): a replica that moves gets a new
    address, and one re-added at the same address is the same process again, whatever the
    names.
    """

    model: Config
    sections: dict[str, SectionDigest]
    section_set: frozenset[SectionDigest]  # the same, for set differences between configs
    named_hosts: tuple[Server, ...]
    guarded: frozenset[str]
    limit: int  # longest CLI line its processes accept

    @classmethod
    def of(cls, model: Config, cache: SectionCache | None = None) -> ConfigDigest:
        sections = (cache or SectionCache()).sections_of(model)
        return cls(
            model=model,
            sections=sections,
            section_set=frozenset(sections.values()),
            named_hosts=tuple(s for sd in sections.values() for s in sd.named_hosts),
            guarded=frozenset(name for name, sd in sections.items() if sd.guarded),
            limit=line_limit(model),
        )

    def server(self, key: str) -> Server | None:
        backend, _, name = key.partition("/")
        section = self.sections.get(backend)
        return section.by_name.get(name) if section is not None else None

    def servers_of(self, backend: str) -> tuple[Server, ...]:
        section = self.sections.get(backend)
        return section.servers if section is not None else ()


# Check state flags (CHK_ST_CONFIGURED | CHK_ST_ENABLED) and the "no result yet" check result.
_CHECK_RUNNING = 0x02 | 0x04
_CHECK_UNKNOWN = "0"


@dataclass(frozen=True)
class LiveStates:
    """The current worker's `show servers state`, boiled down to evidence per endpoint.

    A server whose health check has not concluded yet (a worker just started by a reload
    reports every server UP until its first check) is evidence of nothing.
    """

    down: frozenset[At]  # servers there are DOWN or MAINT, none is alive
    up: frozenset[At]  # unused by the decisions; kept by summarize_states for readers
    pending: frozenset[At]  # only servers whose check has not run yet
    # Verdicts by "backend/server": every server that is not plainly alive, and those
    # configured by host name (their live address differs from the configured one).
    alive_by_key: dict[str, bool | None]


def summarize_states(states: Iterable[ServerState]) -> LiveStates:
    """From parsed states (no check details: op and admin state are the evidence)."""
    down: set[At] = set()
    up: set[At] = set()
    by_key: dict[str, bool | None] = {}
    for st in states:
        where = at(st.backend, endpoint(st.address, st.port))
        (up if st.alive else down).add(where)
        by_key[st.key] = st.alive
    return LiveStates(frozenset(down - up), frozenset(up), frozenset(), by_key)


_LIVE_COLUMNS = (
    "be_name",
    "srv_name",
    "srv_addr",
    "srv_port",
    "srv_op_state",
    "srv_admin_state",
    "srv_check_state",
    "srv_check_result",
)


def _states_pattern(header: str) -> tuple[re.Pattern[str], list[str]]:
    """A regex matching one state line of this header's columns, capturing the ones we use."""
    columns = header[2:].split()
    parts = [r"(\S+)" if c in _LIVE_COLUMNS else r"\S+" for c in columns]
    return re.compile(r"^" + r"[ \t]+".join(parts) + r"[ \t]*$", re.M), [c for c in columns if c in _LIVE_COLUMNS]


# check-state values (as written) whose CONFIGURED and ENABLED bits are both set
_RUNNING_CHECK_STATES = frozenset(str(v) for v in range(256) if v & _CHECK_RUNNING == _CHECK_RUNNING)


def parse_live_states(text: str) -> LiveStates:
    """`show servers state` straight to LiveStates. A 10,000-server answer comes on every
    poll: one regex pass (in C) over the whole text, then a loop that does next to nothing
    for the usual line (alive, checked or unchecked)."""
    down: set[tuple[str, str, str]] = set()
    up: set[tuple[str, str, str]] = set()
    pending: set[tuple[str, str, str]] = set()
    by_key: dict[str, bool | None] = {}
    start = text.find("# be_id")
    while start != -1:
        end = text.find("\n", start)
        header = text[start : end if end != -1 else len(text)]
        pattern, captured = _states_pattern(header)
        following = text.find("# be_id", start + 1)
        block = text[end + 1 : following if following != -1 else len(text)] if end != -1 else ""
        col = {name: i for i, name in enumerate(captured)}
        i_be, i_name, i_addr = col["be_name"], col["srv_name"], col["srv_addr"]
        i_port, i_op, i_admin = col.get("srv_port"), col["srv_op_state"], col["srv_admin_state"]
        i_cstate, i_cres, i_fqdn = col.get("srv_check_state"), col.get("srv_check_result"), col.get("srv_fqdn")
        for v in pattern.findall(block):
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
            by_key[f"{v[i_be]}/{v[i_name]}"] = verdict
        start = following

    def ats(raw: set[tuple[str, str, str]]) -> frozenset[At]:
        return frozenset(f"{b} {a}:{p}" if p.isdigit() else f"{b} {a}" for b, a, p in raw)

    return LiveStates(ats(down - up), frozenset(), ats(pending - up - down), by_key)


@dataclass(frozen=True)
class LiveView:
    """What the latest config, the current worker and the operator say, per (backend, endpoint)."""

    latest: ConfigDigest  # where the latest config routes to
    down: frozenset[At]  # where the current worker has servers and none is alive
    operator: frozenset[str]  # "backend/server" marked dead by an operator
    operator_at: frozenset[At]  # where those servers live in the latest config


def live_view(
    latest: ConfigDigest, live: LiveStates, operator_dead: Iterable[str], previous_down: frozenset[At] = frozenset()
) -> LiveView:
    """Combine the evidence. `previous_down`: the last view's `down`; an endpoint stays down
    while the current worker has no verdict on it yet (right after a reload)."""
    operator = frozenset(operator_dead)
    down = set(live.down) | (previous_down & live.pending)
    for s in latest.named_hosts:
        # The live state shows the resolved address: carry the verdict over by name. Only
        # for host names: during a make-before-break the live states come from the worker
        # that runs the older config, where the same name may sit at another address.
        verdict = live.alive_by_key.get(s.key)
        where = at(s.backend, s.endpoint)
        if verdict is False or (verdict is None and where in previous_down):
            down.add(where)
    for s in latest.named_hosts:
        if live.alive_by_key.get(s.key):
            down.discard(at(s.backend, s.endpoint))
    operator_at = frozenset(at(s.backend, s.endpoint) for k in operator if (s := latest.server(k)) is not None)
    return LiveView(latest, frozenset(down), operator, operator_at)


def dead_in(digest: ConfigDigest, view: LiveView) -> frozenset[str]:
    """The servers of one generation that are known to be dead, as "backend/server".

    A server its own config disables is never routed to by that worker, so it is left out.
    """
    groups = dead_groups_in(digest, view)
    return frozenset().union(*groups.values())


def dropped_in_section(section: SectionDigest, latest: SectionDigest | None) -> frozenset[str]:
    """Rule (a) for one backend: servers of `section` with nothing left at their address in the
    latest config's section of the same name (None: the latest config has no such backend)."""
    present = latest.present if latest is not None else frozenset()
    return frozenset(key for where, keys in section.at_keys.items() if where not in present for key in keys)


Dropped = Callable[[SectionDigest, SectionDigest | None], frozenset[str]]
DeadGroups = Mapping[str, frozenset[str]]  # backend -> its dead servers' keys


def dropped_groups(
    digest: ConfigDigest, latest: ConfigDigest, dropped: Dropped = dropped_in_section
) -> dict[str, frozenset[str]]:
    """Rule (a) for a whole config, per backend (backends with nothing dropped left out).

    Sections identical to the latest config's route to the same endpoints: only the others
    are compared, through `dropped` (which the shell memoizes per pair of sections).
    """
    groups: dict[str, frozenset[str]] = {}
    for section in digest.section_set - latest.section_set:
        keys = dropped(section, latest.sections.get(section.name))
        if keys:
            groups[section.name] = keys
    return groups


def changed_backends(old_latest: ConfigDigest, new_latest: ConfigDigest) -> frozenset[str]:
    """Names of the backends whose section differs between two configs (or is in one only)."""
    return frozenset(s.name for s in old_latest.section_set ^ new_latest.section_set)


def dropped_groups_since(
    previous: Mapping[str, frozenset[str]],
    digest: ConfigDigest,
    new_latest: ConfigDigest,
    changed: frozenset[str],
    dropped: Dropped = dropped_in_section,
) -> dict[str, frozenset[str]]:
    """dropped_groups(digest, new_latest) from `previous`, what it was against an older latest
    config: only the `changed` backends (changed_backends() of the two) are compared again.
    A new config changes a few backends; dozens of generations need not walk all of theirs."""
    groups = dict(previous)
    for name in changed:
        groups.pop(name, None)
        section = digest.sections.get(name)
        latest = new_latest.sections.get(name)
        if section is not None and section is not latest:
            keys = dropped(section, latest)
            if keys:
                groups[name] = keys
    return groups


def dead_groups_in(
    digest: ConfigDigest,
    view: LiveView,
    dropped: Dropped = dropped_in_section,
    dropped_already: Mapping[str, frozenset[str]] | None = None,
    extra: Mapping[str, frozenset[str]] | None = None,
) -> Mapping[str, frozenset[str]]:
    """dead_in() grouped by backend, backends without dead servers left out.

    `dropped_already`: dropped_groups(digest, view.latest) when the caller has it; returned
    itself when the view adds nothing (callers never edit these dicts). `extra`:
    view_extra(digest, view) when the caller has it.
    """
    if dropped_already is None:
        dropped_already = dropped_groups(digest, view.latest, dropped)
    if extra is None:
        extra = view_extra(digest, view)
    if not extra:
        return dropped_already
    groups = dict(dropped_already)
    for name, keys in extra.items():
        groups[name] = groups.get(name, frozenset()) | keys
    return groups


def view_extra(digest: ConfigDigest, view: LiveView) -> dict[str, frozenset[str]]:
    """Rules (b) and (c) for the config of `digest`, per backend: its servers at endpoints the
    current worker reports down, and those an operator marked."""
    extra: dict[str, set[str]] = {}
    for where in view.down | view.operator_at:
        name = where.partition(" ")[0]
        section = digest.sections.get(name)
        if section is not None and where in section.at_keys:
            extra.setdefault(name, set()).update(section.at_keys[where])
    for key in view.operator:
        server = digest.server(key)
        if server is not None and not server.disabled:
            extra.setdefault(server.backend, set()).add(key)
    return {name: frozenset(keys) for name, keys in extra.items()}


def known_dead_servers(
    generation_model: Config,
    latest_model: Config,
    live_states: Sequence[ServerState],
    operator_dead: Iterable[str],
) -> frozenset[str]:
    """Servers of `generation_model` that are dead, by three rules:

    (a) the latest config dropped them, disabled them, or has nothing at their address and
        port in their backend any more (a server moved elsewhere is dead at the old address);
    (b) the current worker reports every server at their backend and address DOWN or MAINT;
    (c) an operator marked them (or the latest config's server of that name) dead.
    A server UP again in the current worker, or re-added at the same address, is not dead.
    """
    view = live_view(ConfigDigest.of(latest_model), summarize_states(live_states), operator_dead)
    return dead_in(ConfigDigest.of(generation_model), view)


def steer_entries(
    digest: ConfigDigest, dead: frozenset[str], no_backup: NoBackup, unusable: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The steer-map entries a worker running `digest.model` needs, given its known-dead servers.

    Only backends that have the guard and a dead primary they could still route to get
    entries. Their requests are spread evenly over the primaries still alive; with none
    alive they all go to the first live backup (every live backup with `option allbackups`);
    with no backup either, `fail-fast` makes the guard answer at once and `keep` leaves
    routing alone. `unusable`: servers the worker itself sees DOWN or in maintenance, which
    a `use-server` rule would skip, so they are no use as targets and need no steering away
    from.
    """
    entries: dict[str, str] = {}
    for backend, keys in sorted(by_backend_of(dead).items()):
        entries.update(backend_entries(digest, backend, keys, no_backup, unusable))
    return entries


def by_backend_of(keys: Iterable[str]) -> dict[str, frozenset[str]]:
    """"backend/server" keys grouped by backend."""
    groups: dict[str, set[str]] = {}
    for key in keys:
        groups.setdefault(key.partition("/")[0], set()).add(key)
    return {backend: frozenset(members) for backend, members in groups.items()}


def backend_entries(
    digest: ConfigDigest, backend: str, dead: frozenset[str], no_backup: NoBackup, unusable: frozenset[str]
) -> dict[str, str]:
    """steer_entries() for one backend; `dead` and `unusable` may hold other backends' keys too."""
    section = digest.sections.get(backend)
    return section_entries(section, dead, no_backup, unusable) if section is not None else {}


def section_entries(
    section: SectionDigest, dead: frozenset[str], no_backup: NoBackup, unusable: frozenset[str]
) -> dict[str, str]:
    """backend_entries() for one section's digest: nothing else goes into them.

    The slot table lists every primary. While some primary is usable, the count is the
    number of slots, and each slot whose server is not usable is overridden with a usable
    primary chosen by rendezvous hashing: the one that ranks first for that slot, a rank no
    other server's fate changes. So a drain costs one added entry per dead primary; a second
    drain adds more without changing what is there, unless it kills an override's target
    (about one backend in L), whose override then changes (a `set map`, a command of its
    own, where added entries travel by the thousand in one payload). Every usable primary
    keeps its own slot and gets the dead slots that rank it first.
    With no usable primary the count is the number of backup targets, each overriding one slot.
    """
    if not section.guarded:
        return {}
    backend = section.name

    def routable(s: Server) -> bool:
        return not s.disabled and s.weight != 0 and s.key not in unusable

    if not any(s.key in dead and routable(s) for s in section.slots):
        return {}
    usable = [s.name for s in section.slots if routable(s) and s.key not in dead]
    if usable:
        entries = {
            slot_key(backend, i): min(usable, key=lambda name, i=i: _rank(backend, i, name))
            for i, s in enumerate(section.slots)
            if not (routable(s) and s.key not in dead)
        }
        entries[count_key(backend)] = str(len(section.slots))
        return entries
    backups = [s.name for s in section.servers if s.backup and routable(s) and s.key not in dead]
    targets = backups if section.all_backups else backups[:1]
    if not targets:
        return {count_key(backend): FAIL_FAST} if no_backup == "fail-fast" else {}
    entries = {slot_key(backend, i): name for i, name in enumerate(targets)}
    entries[count_key(backend)] = str(len(targets))
    return entries


def _rank(backend: str, slot: int, server: str) -> int:
    """Where `server` ranks for taking over `slot` (lowest first). The same in every process
    and after a restart, unlike hash(); spread like a random draw."""
    return zlib.crc32(f"{backend}_{slot} {server}".encode())


def steer_map_entries(
    model: Config, dead: frozenset[str], no_backup: NoBackup, unusable: frozenset[str] = frozenset()
) -> dict[str, str]:
    """steer_entries() for a model not digested yet."""
    return steer_entries(ConfigDigest.of(model), dead, no_backup, unusable)


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


def steered_servers(dead: frozenset[str], entries: Mapping[str, str]) -> list[str]:
    """The dead servers whose backend the entries steer: what an old worker is kept away from."""
    backends = {key.rpartition("_")[0] for key in entries if is_count_key(key)}
    return sorted(key for key in dead if key.partition("/")[0] in backends)


def steered_by_parts(parts: Mapping[str, tuple[frozenset[str], frozenset[str], Mapping[str, str]]]) -> list[str]:
    """steered_servers() from a worker's per-backend parts (dead, unusable, entries): only the
    backends that have dead servers are looked at, not a map of thousands of entries."""
    return sorted(key for backend, (dead, _, entries) in parts.items() if count_key(backend) in entries for key in dead)


# ---------------------------------------------------------------- map diff


@dataclass(frozen=True)
class Phase:
    """Map changes that may be applied in any order, even on parallel connections."""

    adds: tuple[tuple[str, str], ...] = ()
    sets: tuple[tuple[str, str], ...] = ()
    dels: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.adds or self.sets or self.dels)


# Names repeat across workers and pushes: validate each once.
_valid = functools.lru_cache(maxsize=1 << 16)(validate_name)


def diff_map(
    current: Mapping[str, str], desired: Mapping[str, str], keys: Iterable[str] | None = None
) -> list[Phase]:
    """Ordered phases that turn `current` into `desired` without exposing a half state.

    The non-empty ones of diff_phases(): see there.
    """
    return [p for p in diff_phases(current, desired, keys) if p]


def diff_phases(
    current: Mapping[str, str], desired: Mapping[str, str], keys: Iterable[str] | None = None
) -> tuple[Phase, Phase, Phase, Phase, Phase]:
    """The five phases, in order, that turn `current` into `desired` (some may be empty).

    The first ROUTING_PHASES route every request as `desired` does, or to a server that
    `desired` also routes to: once they are answered the worker is steered. The later ones
    tidy up, one `set map` or `del map` command at a time.

    0. New entries, in payloads: a newly steered backend's slots then its count, and a hop
       for each server that overrides stop pointing to (see haproxy/inject.py), to a server
       they point to now. Those overrides can then wait for phase 3: a drain that kills an
       override's target costs a payload entry here instead of a command.
    1. Counts (a count promises the slots below it, so it comes after them), and hops left
       over from an interrupted push.
    2. Slots no longer wanted whose server could get no hop (after the counts that stop
       promising them).
    3. The overrides that moved, and the other slots no longer wanted.
    4. The hops of phase 0, now that nothing points to their servers.

    `desired` holds no hops. Keys are validated for the CLI. `keys`: only these keys can
    differ (the backends that changed since the last push); a map of 10,000 entries need
    not be walked for a change to ten of them.
    """
    if keys is not None:
        wanted = set(keys)
        current = {k: current[k] for k in wanted if k in current}
        desired = {k: desired[k] for k in wanted if k in desired}
    for key, value in desired.items():
        _valid_key(key)
        _valid("server", value)

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
    """The hops diff_phases() adds in phase 0, and per backend the servers that overrides
    stop pointing to but that get no hop (those overrides must change in the routing phases).

    A server that overrides stop pointing to is one the worker must leave (dead, usually;
    or passed over for a server back in service, when leaving it early does no harm). Its
    hop goes to the new target of one of those overrides, else to any target the backend
    keeps. There is no hop where a left-over one holds the key, or where the backend keeps
    no override to take a target from.
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


def backend_of_key(key: str) -> str:
    """The backend a map key belongs to: a hop's is before its `/`; other keys split
    uniquely at their last `_`."""
    backend, hop, _ = key.partition(HOP_SEPARATOR)
    return backend if hop else key.rpartition("_")[0]


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


_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./-]+$")


def _map_path(map_path: str) -> str:
    if not _SAFE_PATH.match(map_path):
        raise ValueError(f"invalid map path {map_path!r}")
    return map_path


def phase_commands(pid: int, map_path: str, phase: Phase) -> list[str]:
    """One CLI command per change, each routed to `pid`."""
    path = _map_path(map_path)
    return [
        *(on_process(pid, f"set map {path} {k} {v}") for k, v in phase.sets),
        *(on_process(pid, f"del map {path} {k}") for k in phase.dels),
        *(on_process(pid, f"add map {path} {k} {v}") for k, v in phase.adds),
    ]


def map_commands(pid: int, map_path: str, current: Mapping[str, str], desired: Mapping[str, str]) -> list[str]:
    """The whole diff as individual `set map` / `del map` / `add map` commands, in a safe order.

    Idempotent: applied to a map that holds `current` it yields `desired`, and the diff
    between `desired` and itself is empty.
    """
    return [cmd for phase in diff_map(current, desired) for cmd in phase_commands(pid, map_path, phase)]


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


@dataclass(frozen=True, eq=False)
class BackendDelta:
    """The map changes that turn one backend's entries `before` into `after`, in the three
    ranks of diff_phases(), with each rank's adds already rendered as payload text.

    A drain changes the same backends in every old worker whose config shares the section,
    so a delta is worked out once and reused for dozens of workers: what is left per worker
    is joining texts, not a walk over its entries."""

    phases: tuple[Phase, ...]
    payloads: tuple[tuple[str, ...], ...]  # each rank's adds: "key value\n" per backend

    @classmethod
    def of(cls, before: Mapping[str, str], after: Mapping[str, str]) -> BackendDelta:
        phases = diff_phases(before, after)
        return cls(phases, tuple(map(_payload, phases)))

    @classmethod
    def between(
        cls, current: Mapping[str, str], desired: Mapping[str, str], keys: Iterable[str] | None
    ) -> BackendDelta:
        """The delta of whole maps (any number of backends), when there are no per-backend parts to go by."""
        phases = diff_phases(current, desired, keys)
        return cls(phases, tuple(map(_payload, phases)))

    @property
    def changes(self) -> int:
        return sum(len(p.adds) + len(p.sets) + len(p.dels) for p in self.phases)

    @property
    def singles(self) -> int:
        """Changes that need a command each (`set map`, `del map`): no payload for those."""
        return sum(len(p.sets) + len(p.dels) for p in self.phases)


PHASES = range(5)


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
        individual = [
            command
            for delta in deltas
            for command in (
                *(on_process(pid, f"set map {path} {k} {v}") for k, v in delta.phases[rank].sets),
                *(on_process(pid, f"del map {path} {k}") for k in delta.phases[rank].dels),
            )
        ]
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


def _payload(phase: Phase) -> tuple[str, ...]:
    """A phase's adds as payload text, one string per backend, in order."""
    groups: dict[str, list[str]] = {}
    for key, value in phase.adds:
        groups.setdefault(backend_of_key(key), []).append(f"{key} {value}\n")
    return tuple("".join(group) for group in groups.values())


@dataclass(frozen=True, eq=False)
class DeltaBatch:
    """Several backends' deltas made into CLI lines once, for every worker that needs the
    same ones: a drain gives dozens of old workers the same deltas, and each of them then
    costs a string replacement per line instead of assembling its lines anew.

    The lines name a stand-in PID as long as the real ones (a line's length must not
    change: it is fitted to the line limit); map keys and values cannot hold `@!`, so
    the stand-in cannot be replaced anywhere else."""

    deltas: tuple[BackendDelta, ...]  # held so that the identities the batch is found by stay valid
    stand_in: str  # "@!<digits> "
    ranks: tuple[tuple[str, ...], ...]
    routing_ranks: int  # the first ranks, those of diff_phases()' routing phases
    writes: Mapping[str, str]  # what the answered lines add or set in the map
    removes: tuple[str, ...]  # what they delete
    changes: int
    singles: int

    @classmethod
    def of(cls, deltas: Sequence[BackendDelta], map_path: str, limit: int, pid_digits: int) -> DeltaBatch:
        stand_in = int("1" * pid_digits)
        writes: dict[str, str] = {}
        removes: list[str] = []
        for delta in deltas:
            for phase in delta.phases:
                writes.update(phase.adds)
                writes.update(phase.sets)
                removes.extend(phase.dels)
        routing = delta_lines(stand_in, map_path, deltas, limit, PHASES[:ROUTING_PHASES])
        tidying = delta_lines(stand_in, map_path, deltas, limit, PHASES[ROUTING_PHASES:])
        return cls(
            deltas=tuple(deltas),
            stand_in=on_process(stand_in, ""),
            ranks=tuple(tuple(lines) for lines in (*routing, *tidying)),
            routing_ranks=len(routing),
            writes=writes,
            removes=tuple(removes),
            changes=sum(d.changes for d in deltas),
            singles=sum(d.singles for d in deltas),
        )

    def lines_for(self, pid: int) -> list[list[str]]:
        """delta_lines() of this batch's deltas for one worker."""
        prefix = on_process(pid, "")
        assert len(prefix) == len(self.stand_in), (pid, self.stand_in)
        return [[line.replace(self.stand_in, prefix) for line in lines] for lines in self.ranks]

    def apply(self, known: dict[str, str]) -> None:
        """Record in `known` what the batch's lines did, once HAProxy answered every one cleanly."""
        known.update(self.writes)
        for key in self.removes:
            known.pop(key, None)


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


def line_limit(model: Config | None) -> int:
    """The longest CLI line the processes accept: tune.bufsize (16384 unless set) minus room."""
    line = model.global_setting("tune.bufsize") if model is not None else None
    if line is not None and len(line.words) > 1 and line.words[1].isdigit():
        return min(DEFAULT_LINE_LIMIT, int(line.words[1]) - 384)
    return DEFAULT_LINE_LIMIT


# ---------------------------------------------------------------- processes


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
# states: at 10,000 servers one read costs HAProxy ~12 ms and this process ~22 ms (860 KB
# to parse), which every 250 ms would be a tenth of a core for a sidecar.
LIVE_READ_SHARE = 20


def live_read_interval(cost_s: float, poll_s: float) -> float:
    """How often the current worker's server states are read: every poll, unless one read
    took longer than 1/LIVE_READ_SHARE of that (then ~0.7 s at 10,000 servers). A server
    that health checks mark DOWN takes `fall` checks, seconds, to be seen; this adds
    a fraction of that."""
    return max(poll_s, LIVE_READ_SHARE * cost_s)


class _Interrupted(Exception):
    """A poll's read was called off for a reload."""


class PushError(Exception):
    """A push or its read-back did not give the map we wanted. One line."""


_GONE = "Can't find the target PID"


class PairMemo(Generic[A, B, R]):
    """f(a, b) remembered per pair of objects, by identity: the arguments are digests and entry
    dicts shared across generations, compared by identity everywhere else too. The objects are
    kept with the result, so an id is never taken over by another object while remembered."""

    def __init__(self, compute: Callable[[A, B], R], max_size: int) -> None:
        self.compute = compute
        self.max_size = max_size
        self.entries: dict[tuple[int, int], tuple[A, B, R]] = {}

    def get(self, a: A, b: B) -> R:
        key = (id(a), id(b))
        memo = self.entries.get(key)
        if memo is None or memo[0] is not a or memo[1] is not b:
            if len(self.entries) > self.max_size:
                self.entries.clear()
            memo = self.entries[key] = (a, b, self.compute(a, b))
        return memo[2]

    def clear(self) -> None:
        self.entries.clear()


@dataclass
class _Worker:
    pid: int
    generation: int | None
    current: bool = False  # the current worker: its map stays empty unless it is about to become old
    # Its map as we know it: read back, or pushed with clean answers. None: read it first.
    known: dict[str, str] | None = None
    # What it needs; None: leave its map alone (its config is unknown or has no guard).
    desired: dict[str, str] | None = None
    # The keys that may differ between known and desired; None: any. Empty: in sync.
    dirty: set[str] | None = None
    # While `dirty` is not None: per backend changed since then, its entries at that time and
    # now (shared objects), from which the push is assembled; None: diff the maps instead.
    transitions: dict[str, tuple[Mapping[str, str], Mapping[str, str]]] | None = None
    dead: frozenset[str] = frozenset()
    dead_groups: dict[str, frozenset[str]] = field(default_factory=dict)
    # Per backend with dead servers: (dead, unusable, entries) the entries were computed from.
    parts: dict[str, tuple[frozenset[str], frozenset[str], dict[str, str]]] = field(default_factory=dict)
    parts_digest: ConfigDigest | None = None  # the digest `parts` were computed with
    # (unusable_version, digest, dead groups) the parts were computed from; objects, compared
    # by identity
    parts_from: tuple[int, ConfigDigest, Mapping[str, frozenset[str]]] | None = None
    # Per backend, the servers it sees DOWN or MAINT itself; a backend missing: ask it.
    unusable: dict[str, frozenset[str]] = field(default_factory=dict)
    unusable_version: int = 0
    pushes: int = 0  # moves at the start and the end of a push: a read-back overlapping one is not trusted
    verify: bool = True  # its map should be read back (after a push, or for a reconcile)
    verified_at: float = 0.0  # monotonic
    unread: int = 0  # read-backs in a row that got no whole answer
    failures: int = 0
    retry_at: float = 0.0  # monotonic
    swept: frozenset[str] = frozenset()  # dead set for which stuck sessions were last ended
    # steered_by_parts(parts), and the parts dict it was computed from (a new dict on every change)
    steered: tuple[object, list[str]] = (None, [])
    # What prepare() worked out for the next config, taken by _update_desired if it still fits.
    prepared: _Update | None = None

    def steered_servers(self) -> list[str]:
        if self.desired is None:
            return []
        if self.steered[0] is not self.parts:
            self.steered = (self.parts, steered_by_parts(self.parts))
        return self.steered[1]


def _update_basis(worker: _Worker, groups: DeadGroups) -> tuple[object, ...]:
    """What an _Update is worked out from, compared by identity: the groups, and the objects
    _update_desired reads or edits in place, each replaced whenever anything else changes it
    (the servers the worker skips itself go by their version, bumped on every change)."""
    return (
        groups, worker.parts, worker.parts_from, worker.parts_digest, worker.desired, worker.dirty,
        worker.transitions,
    )


@dataclass(frozen=True, eq=False)
class _Update:
    """What _update_desired sets in a worker: worked out there, or beforehand by prepare()."""

    basis: tuple[object, ...]  # _update_basis()
    unusable_version: int
    digest: ConfigDigest
    parts_from: tuple[int, ConfigDigest, DeadGroups]
    parts: dict[str, tuple[frozenset[str], frozenset[str], dict[str, str]]]
    fresh: bool  # a new wanted map (set through _want), not an edit of the last one
    desired: dict[str, str]
    dirty: set[str] | None
    transitions: dict[str, tuple[Mapping[str, str], Mapping[str, str]]] | None

    def fits(self, worker: _Worker, digest: ConfigDigest) -> bool:
        """Whether the worker is still exactly as this was worked out from."""
        return (
            digest is self.digest
            and worker.unusable_version == self.unusable_version
            and all(map(operator.is_, _update_basis(worker, worker.dead_groups), self.basis))
        )


class _DeadGroupsOf:
    """A config's dead servers under one live view, grouped by backend (and all of them, made
    when first asked for: after the pushes); and what the groups were made of, so that the
    next ones can tell which backends changed."""

    __slots__ = ("_dead", "dropped", "extra", "groups")

    def __init__(self, groups: DeadGroups, dropped: DeadGroups, extra: frozenset[str]) -> None:
        self.groups = groups
        self.dropped = dropped  # rule (a), dropped_groups()
        self.extra = extra  # the backends rules (b) and (c) added to
        self._dead: frozenset[str] | None = None

    @property
    def dead(self) -> frozenset[str]:
        if self._dead is None:
            self._dead = frozenset().union(*self.groups.values())
        return self._dead


@dataclass
class _Live:
    pid: int
    at: float  # monotonic
    states: LiveStates
    unusable: dict[str, frozenset[str]]  # per backend: not alive in that worker's own view
    cost_s: float = 0.0  # how long asking for them and parsing them took


class DisplacedWorkers:
    """Keeps every old worker steered away from the servers known to be dead.

    Steering is in the critical path of a reload (make-before-break) and of a node's
    death, so it does the least work it can there: entries are recomputed per backend
    whose dead set changed, only changed keys are pushed, and a push counts once HAProxy
    answered every command cleanly. Reading maps back (after a push, and to repair drift)
    happens in the poll loop, a few workers per poll, outside the lock that reloads take.
    """

    STATS_INTERVAL_S = 1.0
    RECONCILE_INTERVAL_S = 5.0
    MAX_BACKOFF_S = 5.0
    WARN_AFTER_S = 5.0  # CLI failures lasting longer than this are logged as warnings

    def __init__(
        self, settings: Settings, state: State, cli: MasterCLI, reconcile_interval_s: float | None = None
    ) -> None:
        if reconcile_interval_s is not None:
            self.RECONCILE_INTERVAL_S = reconcile_interval_s
        self.settings = settings
        self.state = state
        self.cli = cli
        self.map_path = str(settings.haproxy.steer_map)
        self.poll_s = settings.old_workers.poll_interval_ms / 1000
        self._workers: dict[int, _Worker] = {}
        self._digests: dict[int, ConfigDigest] = {}  # id(Config) -> its digest
        self._sections = SectionCache()
        self._entries_memo: dict[tuple, dict[str, str]] = {}
        self._dropped_memo = PairMemo(dropped_in_section, 500_000)  # once per pair of section digests
        self._steered_stale: set[int] = set()  # pids whose `steered` list is to be made anew
        self._dead_sets: tuple[frozenset[str], ...] = ()  # the dead sets state.dead_servers was made of
        # generation digest -> latest config's digest -> dropped_groups() against it, most
        # recently used last; two latest configs: the current one and the one being reloaded to
        self._dropped_by_digest: dict[ConfigDigest, dict[ConfigDigest, DeadGroups]] = {}
        self._changed: tuple[ConfigDigest, ConfigDigest, frozenset[str]] | None = None
        self._last_groups: dict[ConfigDigest, _DeadGroupsOf] = {}  # the last ones its workers were given
        # id(dead groups) -> (those groups, the last ones of the same config, the backends that
        # can differ between the two), for the groups in _dead_cache
        self._groups_since: dict[int, tuple[DeadGroups, DeadGroups, frozenset[str]]] = {}
        self._deltas = PairMemo(BackendDelta.of, 100_000)
        self._batches: dict[tuple[int, ...], DeltaBatch] = {}
        self._reads: set[asyncio.Future[object]] = set()  # the poll's reads under way (_interruptible)
        # view key -> digest -> its dead groups under that view; the last two views
        # (during a reload the next config's view and the current one take turns).
        self._dead_cache: dict[tuple, dict[ConfigDigest, _DeadGroupsOf]] = {}
        self._live: _Live | None = None
        self._down: frozenset[At] = frozenset()  # the last view's down endpoints
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._next: Config | None = None  # set between before_reload and after_reload
        self._prepared: Config | None = None  # the config last prepared for, until after_reload
        self._leaving_pid: int | None = None  # the worker about to become old
        self._stats_at = 0.0
        self._changes = 0
        self.last_push: dict[str, float] = {}  # figures of the last push round, for benchmarks

    # ------------------------------------------------------------ the contract

    async def run(self) -> None:
        """Poll, steer, verify and reconcile until cancelled."""
        failing_since: float | None = None
        while True:
            try:
                due = self._live_due()
                await self.sync(fresh=due, reuse_live=not due)
                await self._interruptible(self._verify_some())
                await self._interruptible(self._read_unusable())
                now = time.monotonic()
                if now >= self._stats_at:
                    self._stats_at = now + self.STATS_INTERVAL_S
                    await self._interruptible(self._update_stats())
                failing_since = None
            except _Interrupted:
                log.debug("old workers: poll interrupted by a reload")
            except CLIError as exc:
                # The master socket resets connections while the master re-executes on a
                # reload (seconds with a big config): only a lasting failure is worth a warning.
                now = time.monotonic()
                failing_since = failing_since or now
                level = logging.WARNING if now - failing_since > self.WARN_AFTER_S else logging.DEBUG
                log.log(level, "old workers: %s", exc)
            except Exception:
                # A bug here must not stop the protection of later reloads.
                log.exception("old workers: unexpected error")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()

    async def prepare(self, next_model: Config) -> None:
        """Work out what before_reload(next_model) will need, while `haproxy -c` checks the
        config on another core: the config's digest, the servers it drops for every old
        config, their dead groups (in the caches before_reload looks in), and each worker's
        next entries (an _Update on copies, taken if the worker is unchanged by then). After
        the check only the pushes are left.

        Nothing is pushed and no worker's wanted map changes: a config that fails the check
        must steer nothing (its dropped servers may be alive)."""
        async with self._lock:
            self._prepared = next_model
            latest = self._digest(next_model)
            current = self.state.current
            leaving = current.worker_pid if current is not None else None
            # The workers _steer will judge once the current one is leaving: all it knows.
            judged = [
                (worker, self._digest(generation.model))
                for worker in self._workers.values()
                if (not worker.current or worker.pid == leaving)
                and worker.generation is not None
                and (generation := self.state.generations.get(worker.generation)) is not None
            ]
            if not judged:
                return
            try:
                view = await self._live_view(latest, leaving, fresh=False, reuse=True)
            except CLIError:
                return  # no server states to go by yet: before_reload works it all out
            dead_of = self._dead_groups_under(view, latest, {digest for _, digest in judged}, given=False)
            for worker, digest in judged:
                if not digest.guarded:
                    continue
                worker.prepared = self._work_out_update(worker, digest, in_place=False, groups=dead_of[digest].groups)

    async def before_reload(self, next_model: Config) -> None:
        """Make-before-break: steer the worker about to become old (and the old ones) away from
        the servers `next_model` drops, before the reload is sent.

        Pass the very Config object that will become the new Generation's model: digests are
        cached by identity (and by section content)."""
        current = self.state.current
        self._next = next_model
        self._leaving_pid = current.worker_pid if current is not None else None
        # The master relays every CLI answer itself, one at a time: a poll's reads (a server
        # state of 10,000 lines, maps read back) would hold up the pushes that matter now.
        for task in self._reads:
            task.cancel()
        try:
            await self.sync()
        except CLIError as exc:
            # Best effort: the reload must not wait on it; after_reload pushes again.
            log.warning("make-before-break steering failed: %s", exc)

    async def after_reload(self, ok: bool) -> None:
        """After a confirmed reload, steer the new old worker at once; after a failed one, undo
        the make-before-break steering of the worker that stays current."""
        self._next = None
        self._leaving_pid = None
        self._drop_prepared()
        try:
            # The server states read before the reload still hold: the new worker reports
            # every server UP until its checks have run, and the next poll reads it anyway.
            await self.sync(reuse_live=True)
        except CLIError as exc:
            log.warning("steering after %s reload failed: %s", "the" if ok else "a failed", exc)

    def _drop_prepared(self) -> None:
        """Forget what prepare() worked out and before_reload did not take."""
        self._prepared = None
        for worker in self._workers.values():
            worker.prepared = None

    async def refresh(self) -> None:
        """Recompute and push now (a runtime change altered the current config)."""
        self._drop_prepared()  # a runtime apply took the place of the reload it was for
        self._digests.clear()
        self._sections = SectionCache()
        self._dead_cache.clear()
        self._groups_since.clear()
        self._dropped_by_digest.clear()
        self._last_groups.clear()
        self._dropped_memo.clear()
        self._changed = None
        await self.sync(fresh=True)

    def mark_dead(self, key: str) -> None:
        self.state.operator_dead.add(_check_key(key))
        self._wake.set()

    def unmark_dead(self, key: str) -> None:
        self.state.operator_dead.discard(_check_key(key))
        self._wake.set()

    # ------------------------------------------------------------ one round

    async def sync(self, fresh: bool = False, reuse_live: bool = False) -> None:
        """One round: list the workers, recompute, push what changed. `fresh`: ask the current
        worker for its server states even if the last answer is younger than a poll;
        `reuse_live`: use the last answer whatever its age."""
        current = self.state.current
        if fresh and self._next is None and current is not None and current.worker_pid is not None:
            # Outside the lock: a reload that starts meanwhile steers with the last answer
            # instead of waiting for this one (10,000 servers take tens of milliseconds).
            await self._interruptible(self._fetch_live(current.worker_pid))
            fresh, reuse_live = False, True
        async with self._lock:
            procs = await self.cli.show_proc()
            if procs.master is None and not procs.workers:
                # An empty answer: the master dropped the connection (a reload under way).
                # Taken literally it would mean every worker is gone.
                raise CLIError("show proc: no answer")
            self._track(procs)
            await self._steer(procs, fresh, reuse_live)

    def _track(self, procs: ProcList) -> None:
        generations = worker_generations(procs, self.state.generations)
        current = procs.current_worker
        old_pids = {p.pid for p in procs.old_workers}
        # The current worker is watched too: its map must stay empty, except while it is
        # about to become old (make-before-break), and be emptied again if the reload fails.
        targets = old_pids | ({current.pid} if current is not None else set())
        for pid in list(self._workers):
            if pid not in targets:
                del self._workers[pid]
        for pid in targets:
            worker = self._workers.get(pid)
            if worker is None:
                worker = self._workers[pid] = _Worker(pid, generations.get(pid))
                if self._live is not None and self._live.pid == pid:
                    # Its own view as last seen while it was current; health checks stop
                    # in an old worker, so that view barely changes (reconcile refreshes it).
                    worker.unusable = dict(self._live.unusable)
            if worker.generation is None:
                worker.generation = generations.get(pid)
            worker.current = current is not None and pid == current.pid
            if worker.current and self._live is not None and self._live.pid == pid:
                worker.unusable = dict(self._live.unusable)
        for pid in list(self.state.old_workers):
            if pid not in old_pids:
                del self.state.old_workers[pid]
        for pid in old_pids:
            if pid not in self.state.old_workers:
                self.state.old_workers[pid] = OldWorker(pid, generations.get(pid), _started_at(pid))
            elif self.state.old_workers[pid].generation is None:
                self.state.old_workers[pid].generation = generations.get(pid)
        self.state.note_old_workers()

    async def _update_stats(self) -> None:
        pids = list(self.state.old_workers)
        if not pids:
            return
        answers = await self.cli.execute_many([on_process(pid, "show info") for pid in pids])
        infos = split_show_info("\n".join(answers))
        for pid in pids:
            worker = self.state.old_workers.get(pid)
            if worker is None:
                continue
            conns = infos.get(pid, {}).get("CurrConns", "")
            worker.connections = int(conns) if conns.isdigit() else worker.connections
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                worker.rss_bytes = psutil.Process(pid).memory_info().rss

    def _digest(self, model: Config) -> ConfigDigest:
        digest = self._digests.get(id(model))
        if digest is None or digest.model is not model:
            digest = self._digests[id(model)] = ConfigDigest.of(model, self._sections)
        return digest

    def _forget_digests(self, latest: Config) -> None:
        """Drop digests of configs no generation runs any more."""
        alive = {id(g.model) for g in self.state.generations.values()} | {id(latest)}
        if self._prepared is not None:
            alive.add(id(self._prepared))
        stale = [k for k in self._digests if k not in alive]
        for key in stale:
            del self._digests[key]
        if stale:
            self._sections.keep_only(self._digests.values())
            # Entries depend on their section and nothing else that changes: keep those of the
            # sections still in use (an old worker's exit during a check must not throw away
            # what prepare() worked out for the reload after it).
            sections = {sd for d in self._digests.values() for sd in d.section_set}
            self._entries_memo = {k: v for k, v in self._entries_memo.items() if k[0] in sections}
            self._deltas.clear()
            self._dropped_memo.clear()
            self._changed = None
            alive = set(self._digests.values())
            self._dropped_by_digest = {
                d: {latest: groups for latest, groups in v.items() if latest in alive}
                for d, v in self._dropped_by_digest.items()
                if d in alive
            }
            self._last_groups = {d: v for d, v in self._last_groups.items() if d in alive}

    async def _live_states(self, current_pid: int, fresh: bool, reuse: bool = False) -> _Live:
        live = self._live
        if live is not None and (reuse or self._next is not None):
            # Around a reload the last answer will do, whatever its age, even from the worker
            # that was current until a moment ago: the steering must not wait on a 10,000-line
            # answer, a new worker reports every server UP until its checks have run, and
            # the poll after the reload reads a fresh one.
            return live
        if fresh or live is None or time.monotonic() - live.at > 2 * live_read_interval(live.cost_s, self.poll_s):
            live = await self._fetch_live(current_pid)
        return live

    async def _live_view(self, latest: ConfigDigest, current_pid: int | None, fresh: bool, reuse: bool) -> LiveView:
        """live_view() for `latest`, from the current worker's server states (_live_states)."""
        states = LiveStates(frozenset(), frozenset(), frozenset(), {})
        if current_pid is not None:
            states = (await self._live_states(current_pid, fresh, reuse)).states
        return live_view(latest, states, self.state.operator_dead, self._down)

    def _live_due(self) -> bool:
        """Whether the poll reads the current worker's server states again now."""
        live, current = self._live, self.state.current
        if live is None or current is None or live.pid != current.worker_pid:
            return True
        return time.monotonic() - live.at >= live_read_interval(live.cost_s, self.poll_s)

    async def _interruptible(self, read: Coroutine[object, object, R]) -> R:
        """Run a poll's read so that before_reload can call it off (raising _Interrupted here).
        Only reads: what they learn is applied after they return, so one called off midway
        leaves nothing half done."""
        task = asyncio.ensure_future(read)
        self._reads.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise _Interrupted from None
            raise
        finally:
            self._reads.discard(task)

    async def _fetch_live(self, current_pid: int) -> _Live:
        """The current worker's server states, asked for and parsed."""
        started = time.monotonic()
        answer = await self.cli.on(current_pid, "show servers state")
        if "# be_id" not in answer:
            raise CLIError(f"show servers state: no answer from worker {current_pid}")
        states = parse_live_states(answer)
        unusable: dict[str, set[str]] = {}
        for key, verdict in states.alive_by_key.items():
            if verdict is False:
                unusable.setdefault(key.partition("/")[0], set()).add(key)
        # Backends missing from the dict are asked again; every backend of its config
        # has an (often empty) answer here.
        per_backend = {b: frozenset(unusable.get(b, ())) for b in self._backends_of(current_pid)}
        per_backend.update({b: frozenset(keys) for b, keys in unusable.items()})
        now = time.monotonic()
        live = self._live = _Live(current_pid, now, states, per_backend, now - started)
        worker = self._workers.get(current_pid)
        if worker is not None and worker.unusable != per_backend:
            worker.unusable, worker.unusable_version = dict(per_backend), worker.unusable_version + 1
        return live

    def _backends_of(self, pid: int) -> list[str]:
        worker = self._workers.get(pid)
        generation = self.state.generations.get(worker.generation) if worker and worker.generation else None
        return list(self._digest(generation.model).sections) if generation is not None else []

    async def _steer(self, procs: ProcList, fresh: bool, reuse_live: bool = False) -> None:
        latest = self._next if self._next is not None else (self.state.current.model if self.state.current else None)
        if latest is None:
            self.state.dead_servers, self._dead_sets = set(), ()
            return
        leaving = self._leaving_pid if self._next is not None else None
        # Which workers get a dead set, and which of those a map that can act on it.
        judged: list[tuple[_Worker, ConfigDigest]] = []
        for worker in self._workers.values():
            generation = self.state.generations.get(worker.generation) if worker.generation is not None else None
            if generation is None:
                worker.dead = frozenset()
                self._want(worker, None)
                self._record(worker, "failed", "the config this worker runs is unknown: it cannot be steered")
                continue
            digest = self._digest(generation.model)
            if worker.current and worker.pid != leaving:
                worker.dead = frozenset()
                if worker.parts:  # a new {} each poll would spoil what prepare() worked out for it
                    worker.parts = {}
                self._want(worker, {} if digest.guarded else None)
                continue
            judged.append((worker, digest))
        dead_of: dict[ConfigDigest, _DeadGroupsOf] = {}
        if judged:
            current = procs.current_worker
            latest_digest = self._digest(latest)
            view = await self._live_view(latest_digest, current.pid if current else None, fresh, reuse_live)
            self._down = view.down
            dead_of = self._dead_groups_under(view, latest_digest, {digest for _, digest in judged})
            steering: list[tuple[_Worker, ConfigDigest]] = []
            for worker, digest in judged:
                worker.dead_groups = dead_of[digest].groups
                if digest.guarded:
                    steering.append((worker, digest))
                else:
                    self._want(worker, None)
                    self._record(worker, "failed", "its config has no guard: it cannot be steered")
        else:
            steering = []
        await self._push_all(steering)
        for worker, digest in judged:
            worker.dead = dead_of[digest].dead  # thousands of keys: put together after the pushes
        self._forget_digests(latest)  # housekeeping: after the pushes, not in their way
        self._list_steered()
        dead_sets = tuple(w.dead for w, _ in judged)  # bookkeeping for the status API, after the push
        if len(dead_sets) != len(self._dead_sets) or any(map(operator.is_not, dead_sets, self._dead_sets)):
            self._dead_sets = dead_sets
            self.state.dead_servers = set().union(*dead_sets)
        if self.settings.old_workers.shutdown_stuck_sessions:
            await self._sweep()

    def _dead_groups_under(
        self, view: LiveView, latest: ConfigDigest, digests: Iterable[ConfigDigest], given: bool = True
    ) -> dict[ConfigDigest, _DeadGroupsOf]:
        """Each config's dead groups under `view`: those of the last two views are kept (during
        a reload the next config's view and the current one take turns). `given`: the
        configs' workers are given these groups now (prepare() only works them out)."""
        view_key = (latest, view.down, view.operator, view.operator_at)
        cache = self._dead_cache.pop(view_key, None) or {}
        self._dead_cache[view_key] = cache  # most recent last
        while len(self._dead_cache) > 2:
            for of in self._dead_cache.pop(next(iter(self._dead_cache))).values():
                self._groups_since.pop(id(of.groups), None)
        result: dict[ConfigDigest, _DeadGroupsOf] = {}
        for digest in digests:
            of = cache.get(digest)
            if of is None:
                of = cache[digest] = self._dead_groups(digest, view, latest)
            result[digest] = of
            if given:
                self._last_groups[digest] = of
        return result

    def _dead_groups(self, digest: ConfigDigest, view: LiveView, latest: ConfigDigest) -> _DeadGroupsOf:
        """dead_groups_in() for one config, noting for _update_desired which backends can differ
        from the dead groups its workers were given last: a drain changes a hundred backends
        of a thousand steered ones, in each of fifty configs."""
        dropped, base, changed = self._dropped_groups(digest, latest)
        extra = view_extra(digest, view)
        groups = dead_groups_in(digest, view, dropped_already=dropped, extra=extra)
        last = self._last_groups.get(digest)
        if last is not None and changed is not None and last.dropped is base:
            self._groups_since[id(groups)] = (groups, last.groups, changed.union(extra, last.extra))
        return _DeadGroupsOf(groups, dropped, frozenset(extra))

    def _dropped_groups(
        self, digest: ConfigDigest, latest: ConfigDigest
    ) -> tuple[DeadGroups, DeadGroups | None, frozenset[str] | None]:
        """dropped_groups(digest, latest), updated from the last latest config it was worked out
        for; that last result, and the backends whose entry can differ from it (None: any)."""
        known = self._dropped_by_digest.setdefault(digest, {})
        groups = known.pop(latest, None)
        if groups is not None:
            known[latest] = groups  # most recently used last
            return groups, groups, frozenset()
        base: DeadGroups | None = None
        changed: frozenset[str] | None = None
        if not known:
            groups = dropped_groups(digest, latest, self._dropped_memo.get)
        else:
            base_latest, base = next(reversed(known.items()))
            if self._changed is None or self._changed[0] is not base_latest or self._changed[1] is not latest:
                self._changed = (base_latest, latest, changed_backends(base_latest, latest))
            changed = self._changed[2]
            groups = dropped_groups_since(base, digest, latest, changed, self._dropped_memo.get)
        known[latest] = groups
        while len(known) > 2:
            del known[next(iter(known))]
        return groups, base, changed

    def _update_desired(self, worker: _Worker, digest: ConfigDigest) -> None:
        """Recompute the entries of the backends whose dead or unusable servers changed."""
        last = worker.parts_from
        if (
            worker.desired is not None
            and last is not None
            and last[0] == worker.unusable_version
            and last[1] is digest
            and last[2] is worker.dead_groups
        ):
            return  # nothing it depends on changed: the usual poll
        prepared, worker.prepared = worker.prepared, None
        update = prepared if prepared is not None and prepared.fits(worker, digest) else None
        if update is None:
            update = self._work_out_update(worker, digest, in_place=True)
        worker.parts_from, worker.parts, worker.parts_digest = update.parts_from, update.parts, digest
        if update.fresh:
            self._want(worker, update.desired)
        else:
            worker.desired, worker.dirty, worker.transitions = update.desired, update.dirty, update.transitions

    def _work_out_update(
        self, worker: _Worker, digest: ConfigDigest, in_place: bool, groups: DeadGroups | None = None
    ) -> _Update:
        """What _update_desired sets in `worker` once it has `groups` (its dead_groups unless
        given). `in_place`: edit its wanted map and change sets (the worker takes the result
        at once); else work on copies, leaving the worker as it is (prepare())."""
        groups = worker.dead_groups if groups is None else groups
        basis = _update_basis(worker, groups)
        fresh = worker.desired is None or worker.parts_digest is not digest
        candidates = self._candidates(worker, digest, groups, fresh)
        parts_from = (worker.unusable_version, digest, groups)
        old_parts = {} if fresh else worker.parts
        parts = dict(old_parts)
        changed: list[str] = []
        worker_unusable, sections, entries_of = worker.unusable, digest.sections, self._entries
        for backend in candidates:
            dead = groups.get(backend, _NOTHING)
            unusable = worker_unusable.get(backend, _NOTHING) if dead else _NOTHING
            previous = old_parts.get(backend)
            if previous is not None and previous[0] == dead and previous[1] == unusable:
                continue
            changed.append(backend)
            if dead:
                parts[backend] = (dead, unusable, entries_of(sections[backend], dead, unusable))
            else:
                del parts[backend]
        if fresh:
            desired: dict[str, str] = {}
            for _, _, entries in parts.values():
                desired.update(entries)
            return _Update(basis, worker.unusable_version, digest, parts_from, parts, True, desired, None, None)
        # Edit in place, noting the keys that moved: a map of thousands of entries is neither
        # copied nor compared whole for a change to a few backends (prepare() has the time).
        assert worker.desired is not None
        desired = worker.desired if in_place else dict(worker.desired)
        transitions = worker.transitions
        if transitions is not None and not in_place:
            transitions = dict(transitions)
        moved: set[str] = set()
        for backend in changed:
            had, has = old_parts.get(backend), parts.get(backend)
            before = had[2] if had is not None else _NO_ENTRIES
            after = has[2] if has is not None else _NO_ENTRIES
            if before:
                for key in before.keys() - after.keys():
                    desired.pop(key, None)
                    moved.add(key)
            desired.update(after)
            moved.update(after)  # unchanged keys too: `dirty` holds the keys that *may* differ
            if transitions is not None:
                first = transitions.get(backend, (before, after))[0]
                transitions[backend] = (first, after)
        dirty = worker.dirty
        if moved and dirty is not None:
            if in_place:
                dirty |= moved
            else:
                dirty = dirty | moved
        return _Update(basis, worker.unusable_version, digest, parts_from, parts, False, desired, dirty, transitions)

    def _candidates(self, worker: _Worker, digest: ConfigDigest, groups: DeadGroups, fresh: bool) -> Iterable[str]:
        """The backends whose entries can differ from the worker's parts once it has `groups`."""
        last = worker.parts_from
        if fresh:
            return groups.keys()
        if last is None or last[0] != worker.unusable_version or last[1] is not digest:
            return groups.keys() | worker.parts.keys()
        # Dead groups are shared objects, replaced only where something changed: a drain
        # touches a hundred of a worker's thousand steered backends, so look at those only
        # (those _dead_groups noted, when it worked these groups out from the last ones).
        before = last[2]
        since = self._groups_since.get(id(groups))
        if since is not None and since[0] is groups and since[1] is before:
            return [b for b in since[2] if before.get(b) is not groups.get(b)]
        candidates = [b for b, dead in groups.items() if before.get(b) is not dead]
        return candidates + [b for b in before if b not in groups]

    def _entries(self, section: SectionDigest, dead: frozenset[str], unusable: frozenset[str]) -> dict[str, str]:
        """section_entries(), shared by the generations whose section is the same object: a
        drain changes the same backends in every old worker."""
        key = (section, dead, unusable)
        entries = self._entries_memo.get(key)
        if entries is None:
            if len(self._entries_memo) > 200_000:
                self._entries_memo.clear()
            no_backup = self.settings.old_workers.no_backup
            entries = self._entries_memo[key] = section_entries(section, dead, no_backup, unusable)
        return entries

    @staticmethod
    def _want(worker: _Worker, desired: dict[str, str] | None) -> None:
        """Replace what a worker's map should hold (None: leave the map alone)."""
        if desired is None or worker.desired is None or desired != worker.desired:
            worker.desired, worker.dirty, worker.transitions = desired, None, None

    async def _read_unusable(self, budget: int = 4) -> None:
        """Ask old workers, for the backends that have dead servers, which servers they already
        skip themselves (DOWN or MAINT in their own view): no use as targets.

        Not in the critical path: a worker is steered first with what is known (usually its
        view from its time as the current worker), and corrected when the answer differs.
        """

        async def some(worker: _Worker, backends: list[str]) -> dict[str, frozenset[str]]:
            commands = [on_process(worker.pid, f"show servers state {validate_name('backend', b)}") for b in backends]
            answers = await self.cli.execute_many(commands)
            if any("# be_id" not in a for a in answers):
                raise CLIError(f"show servers state: no answer from worker {worker.pid}")
            states = parse_servers_state("\n".join(answers))
            return {b: frozenset(s.key for s in states if s.backend == b and not s.alive) for b in backends}

        async def every(worker: _Worker, backends: list[str]) -> dict[str, frozenset[str]]:
            # Many backends: one answer for all of them parses faster than one per backend.
            answer = await self.cli.on(worker.pid, "show servers state")
            if "# be_id" not in answer:
                raise CLIError(f"show servers state: no answer from worker {worker.pid}")
            live = parse_live_states(answer)
            groups = by_backend_of(k for k, verdict in live.alive_by_key.items() if verdict is False)
            return {b: groups.get(b, frozenset()) for b in backends}

        async def one(worker: _Worker, backends: list[str]) -> None:
            with contextlib.suppress(CLIError):
                got = await (some if len(backends) <= 20 else every)(worker, backends)
                if any(worker.unusable.get(b, frozenset()) != v for b, v in got.items()):
                    worker.unusable = {**worker.unusable, **got}
                    worker.unusable_version += 1
                    self._wake.set()
                else:
                    worker.unusable.update(got)

        wanted = [
            (worker, sorted(worker.dead_groups.keys() - worker.unusable.keys()))
            for worker in self._workers.values()
            if worker.desired is not None and not worker.current
        ]
        wanted = [(w, b) for w, b in wanted if b][:budget]
        async with asyncio.TaskGroup() as group:
            for worker, backends in wanted:
                group.create_task(one(worker, backends))

    @staticmethod
    def _in_sync(worker: _Worker) -> bool:
        if worker.known is None or worker.desired is None:
            return False
        if worker.dirty is None and worker.known == worker.desired:
            worker.dirty, worker.transitions = set(), {}
        return worker.dirty == set()

    async def _push_all(self, steering: Sequence[tuple[_Worker, ConfigDigest]] = ()) -> None:
        """Push to every worker whose map is not what it needs. `steering`: workers whose
        entries are brought up to date first, one by one, each pushed as soon as it is: HAProxy
        (another process, on another core) applies one worker's entries while the next
        worker's are worked out here."""
        started = time.monotonic()
        steered_at: dict[int, float] = {}
        self._changes = 0
        self._batches = {}  # only this round's: the deltas they hold are found by identity
        pushing = False
        # Tidying (the phases of diff_phases() after ROUTING_PHASES: `set map` and `del map`
        # commands, each a relay of its own through the master) waits until every worker is
        # steered: the master relays one command at a time, and the pushes that steer come first.
        routing: set[int] = set()  # this round's pushes not steered yet: joined when created
        all_routed = asyncio.Event()
        listed = False

        def routed(pid: int) -> None:
            routing.discard(pid)
            if listed and not routing:
                all_routed.set()

        async def tidy_after_routing(pid: int) -> None:
            routed(pid)
            await all_routed.wait()

        async def one(worker: _Worker) -> None:
            try:
                await self._push(worker, steered_at, tidy_after_routing)
            except (CLIError, PushError, ValueError) as exc:
                worker.known = None  # somewhere in between: read it back before the next try
                self._failed(worker, str(exc))
            else:
                worker.failures = 0
                worker.retry_at = 0.0
                self._record(worker, "ok")
            finally:
                routed(worker.pid)

        def wanted(worker: _Worker, now: float) -> bool:
            if worker.desired is None:
                return False
            if self._in_sync(worker):
                self._record(worker, "ok")  # e.g. steered before the reload made it old
                return False
            if worker.retry_at > now:
                return False
            self._record(worker, "pending")
            return True

        async with asyncio.TaskGroup() as group:

            def start(worker: _Worker) -> None:
                nonlocal pushing
                pushing = True
                routing.add(worker.pid)
                group.create_task(one(worker))

            updated = set()
            for worker, digest in steering:
                self._update_desired(worker, digest)
                updated.add(worker.pid)
                if wanted(worker, time.monotonic()):
                    start(worker)
                    await asyncio.sleep(0)  # let the push get its line out before the next worker
            now = time.monotonic()
            for worker in list(self._workers.values()):
                if worker.pid not in updated and wanted(worker, now):
                    start(worker)
            listed = True
            if not routing:
                all_routed.set()
        finished = time.monotonic()
        if pushing and steered_at:
            self.state.push_duration.observe(finished - started)
            self.last_push = {
                "workers": len(steered_at),
                "changes": self._changes,
                "steered_s": max(steered_at.values()) - started,
                "steered_at": max(steered_at.values()),  # time.monotonic() when the last one was answered
            }

    # Above this many `set map`/`del map` commands for one worker, the whole map is replaced
    # instead (prepare/commit): each such command is a CLI round of its own in HAProxy,
    # while a replacement ships every entry in a few payloads and switches atomically.
    REPLACE_ABOVE = 64
    # Read-backs in a row without a whole answer before the worker's push counts as failed.
    UNREAD_LIMIT = 3

    async def _push(
        self,
        worker: _Worker,
        steered_at: dict[int, float],
        tidy_after_routing: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        desired = worker.desired
        assert desired is not None
        generation = self.state.generations.get(worker.generation) if worker.generation is not None else None
        limit = self._digest(generation.model).limit if generation is not None else DEFAULT_LINE_LIMIT
        if worker.known is None:
            worker.known, worker.dirty, worker.transitions = await self._read_map(worker.pid), None, None
            worker.verified_at = time.monotonic()
            if self._in_sync(worker):
                return
        known = worker.known
        if worker.transitions is not None:
            # The usual case: the map held what we pushed last, and a few backends changed since.
            deltas = [self._delta(before, after) for before, after in worker.transitions.values()]
        else:
            deltas = [BackendDelta.between(known, desired, worker.dirty)]
        batch = self._batch(deltas, limit, len(str(worker.pid)))
        worker.known, worker.pushes = None, worker.pushes + 1  # in between until the answers are in
        if batch.singles > self.REPLACE_ABOVE:
            await self._replace(worker, desired, limit)
            known = dict(desired)
        else:
            self._changes += batch.changes
            for rank, lines in enumerate(batch.lines_for(worker.pid)):
                if rank == batch.routing_ranks:
                    steered_at[worker.pid] = time.monotonic()
                    if tidy_after_routing is not None:
                        await tidy_after_routing(worker.pid)
                await self._send(worker.pid, lines)
            batch.apply(known)
        # Every command answered cleanly: the poll loop reads the map back to verify. The
        # count moves again, so that a read-back that overlapped this push is not trusted.
        steered_at.setdefault(worker.pid, time.monotonic())
        worker.known, worker.dirty, worker.transitions, worker.verify = known, set(), {}, True
        worker.pushes += 1

    def _batch(self, deltas: list[BackendDelta], limit: int, pid_digits: int) -> DeltaBatch:
        """DeltaBatch.of(), once per set of deltas in a push round (_push_all keeps them)."""
        deltas.sort(key=id)  # one order for every worker: backends' deltas go in any order
        key = (limit, pid_digits, *map(id, deltas))
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = DeltaBatch.of(deltas, self.map_path, limit, pid_digits)
        return batch

    def _delta(self, before: Mapping[str, str], after: Mapping[str, str]) -> BackendDelta:
        """BackendDelta.of(), once per pair of entry objects (shared by the workers whose
        sections are the same, see _entries)."""
        return self._deltas.get(before, after)

    async def _replace(self, worker: _Worker, desired: dict[str, str], limit: int) -> None:
        """Swap the whole map at once: a new version filled by payloads, then committed."""
        answer = await self.cli.on(worker.pid, f"prepare map {self.map_path}")
        m = re.search(r"New version created: (\d+)", answer)
        if m is None:
            raise PushError(f"worker {worker.pid}: prepare map: {answer.strip()[:200]}")
        version = int(m[1])
        self._changes += len(desired)
        phase = Phase(adds=tuple((_valid_key(k), _valid("server", v)) for k, v in desired.items()))
        await self._send(worker.pid, phase_lines(worker.pid, self.map_path, phase, limit, version=version))
        await self._send(worker.pid, [on_process(worker.pid, f"commit map @{version} {self.map_path}")])

    async def _send(self, pid: int, lines: list[str]) -> None:
        answers = await asyncio.gather(*(self.cli.execute(line) for line in lines))
        for line, answer in zip(lines, answers, strict=True):
            problem = answer_problem(line, answer)
            if problem:
                raise PushError(f"worker {pid}: {problem}")

    async def _verify_some(self) -> None:
        """Read back the maps that were just pushed, then the ones verified longest ago: each map
        is checked at least every RECONCILE_INTERVAL_S, a bounded number per poll."""
        now = time.monotonic()
        reconcile = self.RECONCILE_INTERVAL_S
        due = [
            w
            for w in self._workers.values()
            if w.desired is not None and w.known is not None and (w.verify or now - w.verified_at >= reconcile)
        ]
        if not due:
            return
        due.sort(key=lambda w: (not w.verify, w.verified_at))
        per_poll = max(4, -(-len(self._workers) * self.poll_s // self.RECONCILE_INTERVAL_S))
        batch = due[: int(per_poll)]

        async def one(worker: _Worker) -> tuple[_Worker, int, dict[str, str] | Exception]:
            pushes = worker.pushes
            try:
                return worker, pushes, await self._read_map(worker.pid)
            except (CLIError, PushError) as exc:
                return worker, pushes, exc

        results = await asyncio.gather(*(one(w) for w in batch))
        async with self._lock:
            for worker, pushes, got in results:
                if self._workers.get(worker.pid) is not worker or worker.pushes != pushes or worker.known is None:
                    continue  # pushed again (or gone) meanwhile: this read proves nothing
                after_push = worker.verify
                if isinstance(got, Exception):
                    # A read that got no whole answer says nothing about the map: read again at
                    # the next poll, and call it a failure only when that keeps happening.
                    worker.unread += 1
                    if worker.unread < self.UNREAD_LIMIT:
                        log.info("reading old worker %d's map back failed, will retry: %s", worker.pid, got)
                        continue
                    self._failed(worker, str(got))
                worker.unread = 0
                worker.verify, worker.verified_at = False, time.monotonic()
                if isinstance(got, Exception):
                    continue
                if not after_push:
                    # A reconcile also sweeps stuck streams again, and re-reads the worker's own
                    # server states where they can have changed: only `observe` marks servers
                    # down in an old worker (no checks run there, admin commands are refused).
                    worker.swept = frozenset()
                    if self.settings.observe.enabled:
                        worker.unusable, worker.unusable_version = {}, worker.unusable_version + 1
                if got != worker.known:
                    missing = sorted(set(worker.known.items()) - set(got.items()))[:3]
                    extra = sorted(set(got.items()) - set(worker.known.items()))[:3]
                    worker.known, worker.dirty, worker.transitions = got, None, None
                    self._failed(worker, f"worker {worker.pid}: map differs: missing {missing}, unexpected {extra}")
                    self._wake.set()

    async def _read_map(self, pid: int) -> dict[str, str]:
        answer = await self.cli.on(pid, f"show map {self.map_path}")
        if not answer:
            # Not even the blank line of an empty map: the master dropped the connection
            # (it does while it re-executes on a reload). Not "an empty map".
            raise PushError(f"worker {pid}: show map: no answer")
        if answer.startswith(_GONE) or "Unknown map" in answer:
            raise PushError(f"worker {pid}: {answer.strip().splitlines()[0]}")
        if not is_whole_answer(answer):
            # Cut off the same way, after some entries: taken as the map, it would read as
            # entries gone missing.
            raise PushError(f"worker {pid}: show map: answer cut off after {len(answer)} bytes")
        return map_entries(answer)

    def _failed(self, worker: _Worker, error: str) -> None:
        worker.failures += 1
        worker.retry_at = time.monotonic() + min(self.MAX_BACKOFF_S, 0.1 * 2**worker.failures)
        if _GONE not in error:
            self.state.push_failures += 1
            log.warning("steering old worker %d failed (attempt %d): %s", worker.pid, worker.failures, error)
        self._record(worker, "failed", error)

    def _record(self, worker: _Worker, result: Literal["ok", "pending", "failed"], error: str | None = None) -> None:
        record = self.state.old_workers.get(worker.pid)
        if record is None:
            return  # the worker about to become old: not listed as old yet
        if result == "ok":
            self._steered_stale.add(worker.pid)  # listed once the pushes are out (_list_steered)
            if record.push.state == "ok":
                return  # keep the time of the push that made it so
        record.push = PushState(result, utcnow() if result != "pending" else record.push.at, error)

    def _list_steered(self) -> None:
        """Status bookkeeping, after the pushes: which dead servers each old worker is kept from."""
        for pid in self._steered_stale:
            worker, record = self._workers.get(pid), self.state.old_workers.get(pid)
            if worker is not None and record is not None and record.push.state == "ok":
                record.steered = worker.steered_servers()
        self._steered_stale.clear()

    async def _sweep(self) -> None:
        """End the streams of old workers that still wait on a dead server."""
        for worker in self._workers.values():
            if not worker.dead or worker.swept == worker.dead or not self._in_sync(worker):
                continue
            try:
                answer = await self.cli.on(worker.pid, "show sess")
                ids = stuck_sessions(answer, worker.dead)
                if ids:
                    await self.cli.execute_many([on_process(worker.pid, f"shutdown session {i}") for i in ids])
                    log.info("old worker %d: ended %d streams stuck on dead servers", worker.pid, len(ids))
                worker.swept = worker.dead
            except CLIError as exc:
                log.warning("old worker %d: cannot end stuck streams: %s", worker.pid, exc)


def _check_key(key: str) -> str:
    backend, sep, server = key.partition("/")
    if not sep:
        raise ValueError(f"invalid server key {key!r}: expected backend/server")
    return f"{validate_name('backend', backend)}/{validate_name('server', server)}"


def _started_at(pid: int) -> datetime | None:
    try:
        return datetime.fromtimestamp(psutil.Process(pid).create_time(), UTC)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
