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

Map layout (one map for all backends): `<backend>_n` = how many targets the backend has
(`0`: answer 503 / close at once), `<backend>_<i>` = the i-th target server, i < n.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

import psutil

from .effective import sha256_text
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
from .haproxy.config import Config, Server
from .haproxy.inject import COUNT_SUFFIX, guarded_backends
from .settings import Settings
from .state import Generation, OldWorker, PushState, State, utcnow

log = logging.getLogger("supervisor.displaced")

NoBackup = Literal["fail-fast", "keep"]
FAIL_FAST = "0"  # the value of `<backend>_n` that makes the guard refuse the request

# ================================================================= pure decisions


def endpoint(address: str, port: int | None) -> str:
    return f"{address}:{port}" if port is not None else address


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


At = tuple[str, str]  # (backend, endpoint)


@dataclass(frozen=True, eq=False)
class ConfigDigest:
    """What the displaced-worker decisions need from one config, worked out once.

    Listing 10,000 servers takes tens of milliseconds; every old worker of a generation and
    every poll reuses this instead. Servers are matched by backend and address (endpoint):
    a replica that moves gets a new address, and one re-added at the same address is the
    same process again, whatever the names.
    """

    model: Config
    servers: tuple[Server, ...]
    by_backend: dict[str, tuple[Server, ...]]
    by_key: dict[str, Server]
    at_keys: dict[At, tuple[str, ...]]  # servers that are not disabled, per (backend, endpoint)
    present: frozenset[At]  # the same, as a set: where this config routes to
    named_hosts: tuple[Server, ...]  # servers given by host name, whose live address differs
    guarded: frozenset[str]
    all_backups: frozenset[str]  # backends with `option allbackups`
    limit: int  # longest CLI line its processes accept

    @classmethod
    def of(cls, model: Config) -> ConfigDigest:
        servers = tuple(model.servers())
        by_backend: dict[str, list[Server]] = {}
        at_keys: dict[At, list[str]] = {}
        for s in servers:
            by_backend.setdefault(s.backend, []).append(s)
            if not s.disabled:
                at_keys.setdefault((s.backend, s.endpoint), []).append(s.key)
        return cls(
            model=model,
            servers=servers,
            by_backend={b: tuple(members) for b, members in by_backend.items()},
            by_key={s.key: s for s in servers},
            at_keys={at: tuple(keys) for at, keys in at_keys.items()},
            present=frozenset(at_keys),
            named_hosts=tuple(s for s in servers if s.port is not None and not _is_ip(s.address)),
            guarded=guarded_backends(model),
            all_backups=frozenset(
                section.name for section in model.backends() if _has_option(section.body, "allbackups")
            ),
            limit=line_limit(model),
        )


# Check state flags (CHK_ST_CONFIGURED | CHK_ST_ENABLED) and the "no result yet" check result.
_CHECK_RUNNING = 0x02 | 0x04
_CHECK_UNKNOWN = "0"


@dataclass(frozen=True)
class LiveStates:
    """The current worker's `show servers state`, boiled down to evidence per endpoint.

    A server whose health check has not concluded yet (a worker just started by a reload
    reports every server UP until its first check) is evidence of nothing.
    """

    down: frozenset[At]  # some server there is DOWN or MAINT ...
    up: frozenset[At]  # ... and some server there is alive (alive wins)
    pending: frozenset[At]  # only servers whose check has not run yet
    alive_by_key: dict[str, bool | None]  # for servers configured by host name


def summarize_states(states: Iterable[ServerState]) -> LiveStates:
    """From parsed states (no check details: op and admin state are the evidence)."""
    down: set[At] = set()
    up: set[At] = set()
    by_key: dict[str, bool | None] = {}
    for st in states:
        at = (st.backend, endpoint(st.address, st.port))
        (up if st.alive else down).add(at)
        by_key[st.key] = st.alive
    return LiveStates(frozenset(down - up), frozenset(up), frozenset(), by_key)


def parse_live_states(text: str) -> LiveStates:
    """`show servers state` straight to LiveStates: a 10,000-server answer on every poll
    must not cost what building a ServerState per line costs."""
    down: set[At] = set()
    up: set[At] = set()
    pending: set[At] = set()
    by_key: dict[str, bool | None] = {}
    idx: dict[str, int] = {}
    width = 0
    for line in text.splitlines():
        if line.startswith("# be_id"):
            columns = line[2:].split()
            idx = {name: i for i, name in enumerate(columns)}
            width = len(columns)
            continue
        if not idx or not line or line[0] == "#":
            continue
        v = line.split()
        if len(v) < width:
            continue
        backend, name, port = v[idx["be_name"]], v[idx["srv_name"]], v[idx["srv_port"]]
        at = (backend, f"{v[idx['srv_addr']]}:{port}" if port.isdigit() else v[idx["srv_addr"]])
        alive = v[idx["srv_op_state"]] != "0" and not int(v[idx["srv_admin_state"]]) & ADMIN_MAINT_MASK
        verdict: bool | None = alive
        if alive and "srv_check_state" in idx:
            check_running = int(v[idx["srv_check_state"]]) & _CHECK_RUNNING == _CHECK_RUNNING
            if check_running and v[idx["srv_check_result"]] == _CHECK_UNKNOWN:
                verdict = None
        if verdict is None:
            pending.add(at)
        else:
            (up if verdict else down).add(at)
        by_key[f"{backend}/{name}"] = verdict
    return LiveStates(frozenset(down - up), frozenset(up), frozenset(pending - up - down), by_key)


@dataclass(frozen=True)
class LiveView:
    """What the latest config, the current worker and the operator say, per (backend, endpoint)."""

    present: frozenset[At]  # where the latest config routes to
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
        at = (s.backend, s.endpoint)
        if verdict is False or (verdict is None and at in previous_down):
            down.add(at)
    for s in latest.named_hosts:
        if live.alive_by_key.get(s.key):
            down.discard((s.backend, s.endpoint))
    operator_at = frozenset((s.backend, s.endpoint) for k in operator if (s := latest.by_key.get(k)) is not None)
    return LiveView(latest.present, frozenset(down), operator, operator_at)


def dead_in(digest: ConfigDigest, view: LiveView) -> frozenset[str]:
    """The servers of one generation that are known to be dead, as "backend/server".

    A server its own config disables is never routed to by that worker, so it is left out.
    """
    ats = digest.present
    bad = (ats - view.present) | (ats & view.down) | (ats & view.operator_at)
    dead = {key for at in bad for key in digest.at_keys[at]}
    dead.update(k for k in view.operator if k in digest.by_key and not digest.by_key[k].disabled)
    return frozenset(dead)


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
    entries. Their requests are spread over the primaries still alive; with none alive they
    all go to the first live backup (every live backup with `option allbackups`); with no
    backup either, `fail-fast` makes the guard answer at once and `keep` leaves routing alone.
    `unusable`: servers the worker itself sees DOWN or in maintenance, which a `use-server`
    rule would skip, so they are no use as targets and need no steering away from.
    """
    entries: dict[str, str] = {}
    for backend in sorted({key.partition("/")[0] for key in dead} & digest.guarded):
        members = digest.by_backend.get(backend, ())
        routable = [s for s in members if not s.disabled and s.key not in unusable and s.weight != 0]
        primaries = [s for s in routable if not s.backup]
        if not any(s.key in dead for s in primaries):
            continue
        targets = [s.name for s in primaries if s.key not in dead]
        if not targets:
            backups = [s.name for s in routable if s.backup and s.key not in dead]
            targets = backups if backend in digest.all_backups else backups[:1]
        if not targets:
            if no_backup == "fail-fast":
                entries[count_key(backend)] = FAIL_FAST
            continue
        for i, name in enumerate(targets):
            entries[slot_key(backend, i)] = name
        entries[count_key(backend)] = str(len(targets))
    return entries


def steer_map_entries(
    model: Config, dead: frozenset[str], no_backup: NoBackup, unusable: frozenset[str] = frozenset()
) -> dict[str, str]:
    """steer_entries() for a model not digested yet."""
    return steer_entries(ConfigDigest.of(model), dead, no_backup, unusable)


def _has_option(body: Iterable, name: str) -> bool:
    return any(line.words[:2] == ("option", name) for line in body)


def count_key(backend: str) -> str:
    return f"{backend}_{COUNT_SUFFIX}"


def slot_key(backend: str, index: int) -> str:
    return f"{backend}_{index}"


def is_count_key(key: str) -> bool:
    return key.endswith(f"_{COUNT_SUFFIX}")


def steered_servers(dead: frozenset[str], entries: Mapping[str, str]) -> list[str]:
    """The dead servers whose backend the entries steer: what an old worker is kept away from."""
    backends = {key.rpartition("_")[0] for key in entries if is_count_key(key)}
    return sorted(key for key in dead if key.partition("/")[0] in backends)


# ---------------------------------------------------------------- map diff


@dataclass(frozen=True)
class Phase:
    """Map changes that may be applied in any order, even on parallel connections."""

    adds: tuple[tuple[str, str], ...] = ()
    sets: tuple[tuple[str, str], ...] = ()
    dels: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.adds or self.sets or self.dels)


def diff_map(current: Mapping[str, str], desired: Mapping[str, str]) -> list[Phase]:
    """Ordered phases that turn `current` into `desired` without exposing a half state.

    A count key promises that its slots exist, so slots are written first, counts second,
    and slots no longer counted are removed last. Keys are validated for the CLI.
    """
    for key, value in desired.items():
        validate_name("map key", key)
        validate_name("server", value)

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
    phases = [
        Phase(adds=slot_adds, sets=slot_sets),
        Phase(adds=count_adds, sets=count_sets, dels=tuple(validate_name("map key", k) for k in counts_had)),
        Phase(dels=tuple(validate_name("map key", k) for k in slots_had)),
    ]
    return [p for p in phases if p]


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


def phase_lines(pid: int, map_path: str, phase: Phase, limit: int = DEFAULT_LINE_LIMIT) -> list[str]:
    """Lines for the master CLI: sets and deletes joined with `;`, adds as `add map` payloads.

    A payload (`add map <file> <<` then one `key value` per line) costs a few bytes per
    entry where a command costs ~60, and HAProxy parses it in one go: it is what makes
    pushing thousands of entries to dozens of workers fast. Each line fits in `limit`.
    """
    path = _map_path(map_path)
    individual = [
        *(on_process(pid, f"set map {path} {k} {v}") for k, v in phase.sets),
        *(on_process(pid, f"del map {path} {k}") for k in phase.dels),
    ]
    lines = batch_lines(individual, limit) if individual else []
    head = on_process(pid, f"add map {path} <<\n")
    chunk: list[str] = []
    size = len(head)
    for key, value in phase.adds:
        entry = f"{key} {value}\n"
        if chunk and size + len(entry) > limit:
            lines.append(head + "".join(chunk))
            chunk, size = [], len(head)
        chunk.append(entry)
        size += len(entry)
    if chunk:
        # The line ends with the payload; the client's final newline is the empty line that ends it.
        lines.append(head + "".join(chunk))
    return lines


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


class PushError(Exception):
    """A push or its read-back did not give the map we wanted. One line."""


_GONE = "Can't find the target PID"


@dataclass
class _Worker:
    pid: int
    generation: int | None
    current: bool = False  # the current worker: its map stays empty unless it is about to become old
    known: dict[str, str] | None = None  # its map as last read back or pushed; None: read it first
    # Per backend, the servers it sees DOWN or MAINT itself; a backend missing: ask it.
    unusable: dict[str, frozenset[str]] = field(default_factory=dict)
    dead: frozenset[str] = frozenset()
    desired: dict[str, str] | None = None  # None: leave its map alone (its config is unknown)
    failures: int = 0
    retry_at: float = 0.0  # monotonic
    swept: frozenset[str] = frozenset()  # dead set for which stuck sessions were last ended


@dataclass
class _Live:
    pid: int
    at: float  # monotonic
    states: LiveStates
    unusable: dict[str, frozenset[str]]  # per backend: not alive in that worker's own view


class DisplacedWorkers:
    """Keeps every old worker steered away from the servers known to be dead."""

    STATS_INTERVAL_S = 1.0
    RECONCILE_INTERVAL_S = 5.0
    MAX_BACKOFF_S = 5.0

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
        self._digests_by_text: dict[str, ConfigDigest] = {}  # sha256 of the rendered model -> its digest
        self._dead_cache: dict[tuple, frozenset[str]] = {}
        self._live: _Live | None = None
        self._down: frozenset[At] = frozenset()  # the last view's down endpoints
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._next: Config | None = None  # set between before_reload and after_reload
        self._leaving_pid: int | None = None  # the worker about to become old
        self._stats_at = 0.0
        self._reconcile_at = time.monotonic() + self.RECONCILE_INTERVAL_S
        self.last_push: dict[str, float] = {}  # timings of the last push round, for benchmarks

    # ------------------------------------------------------------ the contract

    async def run(self) -> None:
        """Poll, steer and reconcile until cancelled."""
        errors = 0
        while True:
            try:
                await self.sync(fresh=True)
                errors = 0
            except CLIError as exc:
                # The master socket resets connections while the master re-executes on a
                # reload: one miss is routine, a run of them is worth a warning.
                errors += 1
                log.log(logging.WARNING if errors >= 3 else logging.DEBUG, "old workers: %s", exc)
            except Exception:
                # A bug here must not stop the protection of later reloads.
                log.exception("old workers: unexpected error")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()

    async def before_reload(self, next_model: Config) -> None:
        """Make-before-break: steer the worker about to become old (and the old ones) away from
        the servers `next_model` drops, before the reload is sent.

        Pass the very Config object that will become the new Generation's model: digests are
        cached by identity (and by content, at the price of rendering it)."""
        current = self.state.current
        self._next = next_model
        self._leaving_pid = current.worker_pid if current is not None else None
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
        try:
            await self.sync()
        except CLIError as exc:
            log.warning("steering after %s reload failed: %s", "the" if ok else "a failed", exc)

    async def refresh(self) -> None:
        """Recompute and push now (a runtime change altered the current config)."""
        self._digests.clear()
        self._digests_by_text.clear()
        self._dead_cache.clear()
        await self.sync(fresh=True)

    def mark_dead(self, key: str) -> None:
        self.state.operator_dead.add(_check_key(key))
        self._wake.set()

    def unmark_dead(self, key: str) -> None:
        self.state.operator_dead.discard(_check_key(key))
        self._wake.set()

    # ------------------------------------------------------------ one round

    async def sync(self, fresh: bool = False) -> None:
        """One round: list the workers, recompute, push what changed. `fresh`: ask the current
        worker for its server states even if the last answer is younger than a poll."""
        async with self._lock:
            procs = await self.cli.show_proc()
            self._track(procs)
            now = time.monotonic()
            if now >= self._reconcile_at:
                # Re-read every map and every worker's own server states: repairs drift
                # (an operator's `clear map`, a lost answer) within one interval.
                self._reconcile_at = now + self.RECONCILE_INTERVAL_S
                for worker in self._workers.values():
                    worker.known = None
                    worker.unusable = {}
                    worker.swept = frozenset()
            await self._steer(procs, fresh)
            if now >= self._stats_at:
                self._stats_at = now + self.STATS_INTERVAL_S
                await self._update_stats()

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
        if digest is not None and digest.model is model:
            return digest
        text = sha256_text(model.render())
        digest = self._digests_by_text.get(text)
        if digest is None:
            digest = self._digests_by_text[text] = ConfigDigest.of(model)
        self._digests[id(model)] = digest
        return digest

    def _forget_digests(self, latest: Config) -> None:
        """Drop digests of configs no generation runs any more."""
        alive = {id(g.model) for g in self.state.generations.values()} | {id(latest)}
        for key in [k for k in self._digests if k not in alive]:
            del self._digests[key]
        kept = {id(d) for d in self._digests.values()}
        for text in [t for t, d in self._digests_by_text.items() if id(d) not in kept]:
            del self._digests_by_text[text]
        if len(self._dead_cache) > 4 * max(1, len(self._workers)):
            self._dead_cache.clear()

    async def _live_states(self, current_pid: int, fresh: bool) -> _Live:
        live = self._live
        if fresh or live is None or time.monotonic() - live.at > self.poll_s:
            answer = await self.cli.on(current_pid, "show servers state")
            states = parse_live_states(answer)
            unusable: dict[str, set[str]] = {}
            for key, verdict in states.alive_by_key.items():
                if verdict is False:
                    unusable.setdefault(key.partition("/")[0], set()).add(key)
            backends = {key.partition("/")[0] for key in states.alive_by_key}
            per_backend = {b: frozenset(unusable.get(b, ())) for b in backends}
            live = self._live = _Live(current_pid, time.monotonic(), states, per_backend)
        return live

    async def _steer(self, procs: ProcList, fresh: bool) -> None:
        latest = self._next if self._next is not None else (self.state.current.model if self.state.current else None)
        if latest is None:
            self.state.dead_servers = set()
            return
        self._forget_digests(latest)
        leaving = self._leaving_pid if self._next is not None else None
        # Which workers get a dead set, and which of those a map that can act on it.
        judged: list[tuple[_Worker, ConfigDigest]] = []
        for worker in self._workers.values():
            generation = self.state.generations.get(worker.generation) if worker.generation is not None else None
            worker.dead = frozenset()
            if generation is None:
                worker.desired = None
                self._record(worker, "failed", "the config this worker runs is unknown: it cannot be steered")
                continue
            digest = self._digest(generation.model)
            if worker.current and worker.pid != leaving:
                worker.desired = {} if digest.guarded else None
                continue
            judged.append((worker, digest))
        if not judged:
            self.state.dead_servers = set()
            await self._push_all()
            return
        current = procs.current_worker
        states = LiveStates(frozenset(), frozenset(), frozenset(), {})
        if current is not None:
            states = (await self._live_states(current.pid, fresh)).states
        latest_digest = self._digest(latest)
        view = live_view(latest_digest, states, self.state.operator_dead, self._down)
        self._down = view.down
        view_key = (id(latest_digest), view.down, view.operator, view.operator_at)
        steering: list[tuple[_Worker, ConfigDigest]] = []
        for worker, digest in judged:
            cache_key = (id(digest), *view_key)
            dead = self._dead_cache.get(cache_key)
            if dead is None:
                dead = self._dead_cache[cache_key] = dead_in(digest, view)
            worker.dead = dead
            if digest.guarded:
                steering.append((worker, digest))
            else:
                worker.desired = None
                self._record(worker, "failed", "its config has no guard: it cannot be steered")
        self.state.dead_servers = set().union(*(w.dead for w, _ in judged))
        await self._read_unusable([w for w, _ in steering])
        for worker, digest in steering:
            affected = {key.partition("/")[0] for key in worker.dead}
            unusable = frozenset().union(*(worker.unusable.get(b, frozenset()) for b in affected))
            worker.desired = steer_entries(digest, worker.dead, self.settings.old_workers.no_backup, unusable)
        await self._push_all()
        if self.settings.old_workers.shutdown_stuck_sessions:
            await self._sweep()

    async def _read_unusable(self, workers: list[_Worker]) -> None:
        """Ask each worker, for the backends that have dead servers, which servers it already
        skips itself (DOWN or MAINT in its own view): no use as targets."""

        async def one(worker: _Worker, backends: list[str]) -> None:
            commands = [on_process(worker.pid, f"show servers state {validate_name('backend', b)}") for b in backends]
            try:
                answers = await self.cli.execute_many(commands)
            except CLIError:
                return
            states = parse_servers_state("\n".join(answers))
            for backend in backends:
                worker.unusable[backend] = frozenset(s.key for s in states if s.backend == backend and not s.alive)

        async with asyncio.TaskGroup() as group:
            for worker in workers:
                wanted = sorted({key.partition("/")[0] for key in worker.dead} - set(worker.unusable))
                if wanted:
                    group.create_task(one(worker, wanted))

    async def _push_all(self) -> None:
        now = time.monotonic()
        todo = [w for w in self._workers.values() if w.desired is not None and w.known != w.desired]
        todo = [w for w in todo if w.retry_at <= now]
        for worker in self._workers.values():
            if worker.desired is not None and worker.known == worker.desired:
                self._record(worker, "ok")  # e.g. steered before the reload made it old
        for worker in todo:
            self._record(worker, "pending")
        if not todo:
            return
        started = time.monotonic()
        steered_at: dict[int, float] = {}

        async def one(worker: _Worker) -> None:
            try:
                await self._push(worker, steered_at)
            except (CLIError, PushError, ValueError) as exc:
                self._failed(worker, str(exc))
            else:
                worker.failures = 0
                worker.retry_at = 0.0
                self._record(worker, "ok")

        async with asyncio.TaskGroup() as group:
            for worker in todo:
                group.create_task(one(worker))
        finished = time.monotonic()
        pushed = list(steered_at.values())
        if pushed:
            self.state.push_duration.observe(finished - started)
            self.last_push = {
                "workers": len(pushed),
                "steered_s": max(pushed) - started,
                "verified_s": finished - started,
            }

    async def _push(self, worker: _Worker, steered_at: dict[int, float]) -> None:
        assert worker.desired is not None
        generation = self.state.generations.get(worker.generation) if worker.generation is not None else None
        limit = self._digest(generation.model).limit if generation is not None else DEFAULT_LINE_LIMIT
        if worker.known is None:
            worker.known = await self._read_map(worker.pid)
            if worker.known == worker.desired:
                return
        phases = diff_map(worker.known, worker.desired)
        # From here on the map is in between; read it back before trusting it again.
        worker.known = None
        for phase in phases:
            lines = phase_lines(worker.pid, self.map_path, phase, limit)
            answers = await asyncio.gather(*(self.cli.execute(line) for line in lines))
            errors = [a.strip() for a in answers if a.strip()]
            if errors:
                raise PushError(f"worker {worker.pid}: {errors[0].splitlines()[0]}")
        steered_at[worker.pid] = time.monotonic()
        got = await self._read_map(worker.pid)
        worker.known = got
        if got != worker.desired:
            missing = sorted(set(worker.desired.items()) - set(got.items()))[:3]
            extra = sorted(set(got.items()) - set(worker.desired.items()))[:3]
            raise PushError(f"worker {worker.pid}: map read back differs: missing {missing}, unexpected {extra}")

    async def _read_map(self, pid: int) -> dict[str, str]:
        answer = await self.cli.on(pid, f"show map {self.map_path}")
        if answer.startswith(_GONE) or "Unknown map" in answer:
            raise PushError(f"worker {pid}: {answer.strip().splitlines()[0]}")
        return map_entries(answer)

    def _failed(self, worker: _Worker, error: str) -> None:
        worker.known = None
        worker.failures += 1
        worker.retry_at = time.monotonic() + min(self.MAX_BACKOFF_S, 0.1 * 2**worker.failures)
        gone = _GONE in error
        if not gone:
            self.state.push_failures += 1
            log.warning("steering old worker %d failed (attempt %d): %s", worker.pid, worker.failures, error)
        self._record(worker, "failed", error)

    def _record(self, worker: _Worker, result: Literal["ok", "pending", "failed"], error: str | None = None) -> None:
        record = self.state.old_workers.get(worker.pid)
        if record is None:
            return  # the worker about to become old: not listed as old yet
        if result == "ok" and record.push.state == "ok":
            record.steered = steered_servers(worker.dead, worker.desired or {})
            return  # keep the time of the push that made it so
        record.push = PushState(result, utcnow() if result != "pending" else record.push.at, error)
        if result == "ok":
            record.steered = steered_servers(worker.dead, worker.desired or {})

    async def _sweep(self) -> None:
        """End the streams of old workers that still wait on a dead server."""
        for worker in self._workers.values():
            if not worker.dead or worker.swept == worker.dead or worker.known != worker.desired:
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
