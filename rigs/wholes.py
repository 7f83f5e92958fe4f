"""The product's incremental and composed functions taken whole: what the tests hold the
product to, built only from its public parts. The daemon never needs these at once (it
parses in parts, steers from memoised plans), so they live here, not in supervisor/."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from supervisor.haproxy.answers import ServerState
from supervisor.haproxy.api import on_process
from supervisor.haproxy.config import Config
from supervisor.haproxy.guard import (
    GUARD_MARKER,
    GUARD_REDISPATCH,
    guard_rules,
    guard_use_server,
    inject_guard_and_table,
    is_count_key,
    is_guarded,
)
from supervisor.haproxy.routing import ID_TIMES_4096, NodeKeys
from supervisor.haproxy.runtime.plan import ServerChange, runtime_plan
from supervisor.haproxy.server_state import server_state_parts
from supervisor.steering.dead import At, ConfigDigest, Sections, at, by_backend_of, dead_groups, live_view
from supervisor.steering.live import LiveStates, LiveTally
from supervisor.steering.mapdiff import Phase, diff_phases
from supervisor.steering.plan import NoBackup, section_entries


def parse_live_states(text: str) -> LiveStates:
    """`show servers state` straight to LiveStates: LiveTally fed the whole answer at once."""
    tally = LiveTally()
    tally.add(text)
    return tally.result()


def filter_server_state(text: str, running: Config, new: Config, forget: Collection[str] = ()) -> str:
    """The saved `show servers state`, keeping only what the new worker should inherit."""
    return "".join(server_state_parts(text, running, new, forget))


def server_state_target(config: Config) -> Path | None:
    """The file the worker of `config` loads its server state from, when it can be known.

    The global `server-state-file`: absolute, or relative to an absolute
    `server-state-base`. A relative path without a base resolves against HAProxy's
    working directory, which is not ours to guess: None.
    """
    line = config.global_setting("server-state-file")
    if line is None or len(line.words) < 2:
        return None
    path = Path(line.words[1])
    if path.is_absolute():
        return path
    base = config.global_setting("server-state-base")
    if base is not None and len(base.words) >= 2 and Path(base.words[1]).is_absolute():
        return Path(base.words[1]) / path
    return None


def plan_runtime_apply(running: Config, new: Config) -> list[ServerChange] | None:
    """The in-place runtime changes that turn `running` into `new`, or None when they cannot
    (a reload, or servers added or removed: runtime_plan() has those).

    [] means nothing HAProxy sees differs (comments, spacing). Pass like with like:
    both effective configs (or both rendered), so injections compare equal.
    """
    plan = runtime_plan(running, new)
    return None if plan.membership_changes else plan.changes


def to_endpoint(change: ServerChange) -> str:
    """Where a change moves its server, as an address with its port."""
    host = f"[{change.to_address}]" if ":" in change.to_address else change.to_address
    return host if change.to_port is None else f"{host}:{change.to_port}"


def known_dead_servers(
    generation_model: Config, latest_model: Config, live_states: Iterable[ServerState], operator_dead: Iterable[str]
) -> frozenset[str]:
    """The dead servers of `generation_model` as "backend/server", straight from the models:
    the reference the memoised plan is checked against."""
    sections = Sections()
    latest = sections.digest(latest_model)
    view = live_view(latest, summarize_states(live_states), operator_dead)
    return frozenset().union(*dead_groups(sections.digest(generation_model), latest, view).values())


def steer_entries(
    digest: ConfigDigest,
    dead: Iterable[str],
    no_backup: NoBackup,
    unusable: frozenset[str] = frozenset(),
    node_keys: NodeKeys = ID_TIMES_4096,
) -> dict[str, str]:
    """The whole steer map a worker running `digest` needs, given its dead servers."""
    entries: dict[str, str] = {}
    for backend, keys in sorted(by_backend_of(dead).items()):
        section = digest.sections.get(backend)
        if section is not None:
            entries.update(section_entries(section, keys, no_backup, unusable, node_keys))
    return entries


def steered_servers(dead: Iterable[str], entries: Mapping[str, str]) -> list[str]:
    """The dead servers whose backend the entries steer: what an old worker is kept away from."""
    backends = {key.rpartition("_")[0] for key in entries if is_count_key(key)}
    return sorted(key for key in dead if key.partition("/")[0] in backends)


def diff_map(current: Mapping[str, str], desired: Mapping[str, str]) -> list[Phase]:
    """Ordered phases that turn `current` into `desired` without exposing a half state.

    The non-empty ones of diff_phases(): see there.
    """
    return [p for p in diff_phases(current, desired) if p]


def map_commands(pid: int, map_path: str, current: Mapping[str, str], desired: Mapping[str, str]) -> list[str]:
    """The whole diff as individual `set map` / `del map` / `add map` commands, in a safe order.

    Idempotent: applied to a map that holds `current` it yields `desired`, and the diff
    between `desired` and itself is empty.
    """
    return [cmd for phase in diff_map(current, desired) for cmd in phase_commands(pid, map_path, phase)]


def summarize_states(states: Iterable[ServerState]) -> LiveStates:
    """From parsed states (no check details: op and admin state are the evidence)."""
    down: set[At] = set()
    up: set[At] = set()
    by_key: dict[str, bool | None] = {}
    for st in states:
        where = at(st.backend, f"{st.address}:{st.port}" if st.port is not None else st.address)
        alive = st.op_state != 0 and not st.in_maint
        (up if alive else down).add(where)
        by_key[st.key] = alive
    return LiveStates(frozenset(down - up), frozenset(), by_key)


def phase_commands(pid: int, map_path: str, phase: Phase) -> list[str]:
    """One CLI command per change, each routed to `pid`."""
    return [
        *(on_process(pid, f"set map {map_path} {k} {v}") for k, v in phase.sets),
        *(on_process(pid, f"del map {map_path} {k}") for k in phase.dels),
        *(on_process(pid, f"add map {map_path} {k} {v}") for k, v in phase.adds),
    ]


def guard_block(mode: str, map_path: str, slot_table_path: str, redispatch: bool = True) -> list[str]:
    """The guard's whole block as it reads when nothing else sits between its rules and its
    `use-server` (with its `option redispatch 1`, unless the config says how to redispatch)."""
    extra = [GUARD_REDISPATCH] if redispatch else []
    return [GUARD_MARKER, *extra, *guard_rules(mode, map_path, slot_table_path), guard_use_server()]


def guarded_backends(config: Config) -> frozenset[str]:
    """Names of the backends whose guard block a steer map can drive."""
    return frozenset(s.name for s in config.backends() if is_guarded(s))


def inject_guard(config: Config, map_path: str | Path, slot_table_path: str | Path) -> Config:
    """inject_guard_and_table(), its rules naming `slot_table_path` instead of the
    content-addressed table it makes (a path the rules may name, else ValueError)."""
    guard_rules("tcp", str(map_path), str(slot_table_path))
    guarded, table = inject_guard_and_table(config, map_path, Path(slot_table_path).parent)
    return Config.parse(guarded.render().replace(f"map({table.path})", f"map({slot_table_path})"))
