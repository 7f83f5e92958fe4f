"""The stalled-connection detector (docs/steering.md#stalled-connections): a connect to a vanished
node stays in SYN-SENT, which sock_diag shows long before a `timeout connect` or a check concludes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import socket
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Set
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from ..eventloop import give_back_free_heap, next_tick, sliced
from ..haproxy.answers import ServerKey
from ..haproxy.api import CLIError, MasterCLI
from ..haproxy.handoff import HANDOFF_FRONTEND
from ..haproxy.resolution import is_ip, section_servers
from ..logs import RecurringCondition
from ..master.processes import socket_inodes, still_open
from ..master.sockdiag import (
    TCP_ESTABLISHED,
    TCP_SYN_SENT,
    TIMER_RETRANSMIT,
    DiagSocket,
    SockDiagError,
    TcpActivity,
    TcpCounters,
    destroy,
    tcp_sockets,
)
from ..settings import DetectorSettings
from ..state import Generation, State, SuspectServer
from .dead import by_backend_of
from .push import end_stuck_streams

Endpoint = tuple[str, int]  # (address, port) of a server as its sockets name it

# A connect or a segment is stalled past this many round trips (and the floor).
RTT_FACTOR = 8
# How long a `health down` waits for the current worker to handle the connects aborted before it.
ABORT_SETTLE_S = 0.25


@dataclass(frozen=True)
class Stall:
    endpoint: Endpoint
    why: str  # "connect" (SYN-SENT) or "retransmit" (established, data unacknowledged)
    age_ms: float  # a lower bound, from the kernel's timer (and first sight)
    socket: DiagSocket


@dataclass(frozen=True)
class Suspect:
    key: str  # "backend/server"
    endpoint: Endpoint
    why: str
    since: float  # time.time() of when its oldest stalled socket stalled


def stall_of(sock: DiagSocket, first_seen_ago_ms: float = 0.0) -> Stall | None:
    """The current retransmit interval has lasted rto - expires; with retransmissions behind
    it, the intervals before (each half the next) at least another rto/2."""
    if sock.timer != TIMER_RETRANSMIT:
        return None
    if sock.state == TCP_SYN_SENT:
        why = "connect"
    elif sock.state == TCP_ESTABLISHED and sock.wqueue > 0 and sock.retrans > 0:
        why = "retransmit"
    else:
        return None
    rto = sock.rto_ms if sock.rto_ms is not None else 1000.0 if why == "connect" else 200.0
    age = max(0.0, rto - sock.expires_ms) + (rto / 2 if sock.retrans > 0 else 0.0)
    return Stall((sock.dst, sock.dport), why, max(age, first_seen_ago_ms), sock)


def nothing_to_dump(last: TcpCounters | None, now: TcpCounters | None) -> bool:
    """Whether the counters since the last dump say no socket can have stalled: nothing
    retransmitted, and every connect begun has already failed (refused or unreachable), as
    each check of a server whose port is closed does. A failed accepted handshake counts in
    AttemptFails too and could hide one pending connect until its SYN is sent again."""
    return (
        last is not None and now is not None and now.retrans == last.retrans
        and now.opens - last.opens == now.failed - last.failed
    )


def threshold_ms(rtts_ms: Iterable[float], floor_ms: float) -> float:
    """How long a stall must last to count: a WAN server's connect takes longer."""
    return max(floor_ms, RTT_FACTOR * max(rtts_ms, default=0.0))


def suspects(
    stalls: Iterable[Stall],
    servers: Mapping[Endpoint, tuple[str, ...]],
    rtts_ms: Mapping[Endpoint, float],
    floor_ms: float,
    now: float,
) -> dict[str, Suspect]:
    found: dict[str, Suspect] = {}
    for stall in stalls:
        keys = servers.get(stall.endpoint)
        if not keys:
            continue
        rtt = rtts_ms.get(stall.endpoint)
        if stall.age_ms < threshold_ms(() if rtt is None else (rtt,), floor_ms):
            continue
        since = now - stall.age_ms / 1000
        for key in keys:
            known = found.get(key)
            if known is None or since < known.since:
                found[key] = Suspect(key, stall.endpoint, stall.why, since)
    return found


def left_in(suspect_keys: Iterable[str], backends: Mapping[str, tuple[str, ...]], dead: Set[str]) -> set[str]:
    """The suspects of a backend in which every server (backups included) is suspect or known
    dead: the current worker keeps routing to them. A live server with a full accept queue
    stalls connects as a vanished one does: taking the last one out turns a slow answer into
    a sure 503 (Envoy's panic mode)."""
    suspect = set(suspect_keys)
    kept: set[str] = set()
    for backend, keys in by_backend_of(suspect).items():
        if not any(s not in suspect and s not in dead for s in backends.get(backend, ())):
            kept.update(keys)
    return kept


def idle(sock: DiagSocket) -> bool:
    """A pooled idle connection. Empty queues are not enough: a request acknowledged and not
    yet answered has them too, so its last data must have come in after its last went out."""
    if sock.state != TCP_ESTABLISHED or sock.wqueue or sock.rqueue or sock.data_segs_in == 0:
        return False
    return sock.sent_ago_ms is None or sock.received_ago_ms is None or sock.received_ago_ms <= sock.sent_ago_ms


def to_abort(
    stalls: Iterable[Stall],
    owners: Mapping[int, int],
    keys_at: Mapping[Endpoint, tuple[str, ...]],
    held: Set[str],
    current_pid: int | None,
    steered: Mapping[int, Set[str]],
    own_keys_at: Mapping[int, Mapping[Endpoint, tuple[str, ...]]],
    dead: Set[str],
    kept: Set[str] = frozenset(),
) -> list[tuple[Stall, str]]:
    """The stalled sockets to destroy, whatever their age, each with why:
    - "suspect": toward a held suspect (`held`), in a worker that routes nothing more to it:
      the current worker (it is set down in the same poll), or an old worker steered off it
      (`steered`). Not those the current worker keeps (`kept`, left_in()): a server with a
      full accept queue may still take them.
    - "dead": an old worker's connect toward an endpoint where every server of its own config
      (`own_keys_at`) is known dead and steered off in it: its retry is redispatched.
    `owners`: socket inode -> worker PID; a socket of no worker is left alone."""
    found: list[tuple[Stall, str]] = []
    for stall in stalls:
        pid = owners.get(stall.socket.inode)
        if pid is None:
            continue
        off = steered.get(pid, frozenset())
        keys = keys_at.get(stall.endpoint, ())
        if pid == current_pid:
            suspect = any(k in held and k not in kept for k in keys)
        else:
            suspect = any(k in held for k in keys) and any(k in off for k in keys)
        if suspect:
            found.append((stall, "suspect"))
            continue
        if pid == current_pid or stall.why != "connect":
            continue
        mine = own_keys_at.get(pid, {}).get(stall.endpoint, ())
        if mine and all(k in off and k in dead for k in mine):
            found.append((stall, "dead"))
    return found


log = logging.getLogger(__name__)
_T = TypeVar("_T")

CAP_NET_ADMIN = 12


def has_net_admin() -> bool:
    """May this process destroy others' sockets?"""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    return False


# Backends (or endpoints, when merging) worked through between two turns of the event loop:
# a config of 10,000 servers is indexed in slices, never in one callback.
SLICE = 50
MERGE_SLICE = 2000


@dataclass(frozen=True)
class ServerIndex:
    """The current config's servers as their sockets name them."""

    sha256: str  # the config indexed; "" for several merged
    by_endpoint: dict[Endpoint, tuple[str, ...]]
    checked: frozenset[str]  # servers with a health check: `health down` is undone by it
    keys: frozenset[str]
    ports: frozenset[int]
    families: tuple[int, ...]
    backends: dict[str, tuple[str, ...]]  # backend -> every server it can route to (left_in)

    @classmethod
    def building(cls, generation: Generation) -> Generator[None, None, ServerIndex]:
        by_endpoint: dict[Endpoint, list[str]] = {}
        checked: set[str] = set()
        families: set[int] = set()
        backends: dict[str, tuple[str, ...]] = {}
        model = generation.model
        for n, (section, settings) in enumerate(model.each_backend_with_settings()):
            servers = [s for s in section_servers(section, settings, model.cache) if not s.disabled]
            backends[section.name] = tuple(s.key for s in servers)
            for server in servers:
                if server.port is None or not is_ip(server.address):
                    continue
                family = socket.AF_INET6 if ":" in server.address else socket.AF_INET
                families.add(family)
                address = socket.inet_ntop(family, socket.inet_pton(family, server.address))
                address = server.address if address == server.address else address  # the config's string
                by_endpoint.setdefault((address, server.port), []).append(server.key)
                if server.check:
                    checked.add(server.key)
            if n % SLICE == SLICE - 1:
                yield
        return cls(
            generation.effective_sha256, {e: tuple(k) for e, k in by_endpoint.items()}, frozenset(checked),
            frozenset(k for keys in by_endpoint.values() for k in keys),
            frozenset(p for _, p in by_endpoint), tuple(sorted(families)), backends,
        )


def merging(indexes: list[ServerIndex]) -> Generator[None, None, ServerIndex]:
    """One index of them all. Configs a reload apart mostly hold the same servers: what comes out
    equal to the first index's is that very object, not a copy."""
    by_endpoint: dict[Endpoint, tuple[tuple[str, ...], dict[str, None]]] = {}
    for index in indexes:
        for n, (endpoint, keys) in enumerate(index.by_endpoint.items()):
            by_endpoint.setdefault(endpoint, (keys, {}))[1].update(dict.fromkeys(keys))
            if n % MERGE_SLICE == MERGE_SLICE - 1:
                yield
    first = indexes[0]
    checked = frozenset().union(*(i.checked for i in indexes))
    keys = frozenset().union(*(i.keys for i in indexes))
    return ServerIndex(
        "", {e: _same_or(seen, tuple(k)) for e, (seen, k) in by_endpoint.items()},
        _same_or(first.checked, checked), _same_or(first.keys, keys),
        _same_or(first.ports, frozenset(p for _, p in by_endpoint)),
        tuple(sorted(set().union(*(i.families for i in indexes)))), {},
    )


def _same_or(seen: _T, made: _T) -> _T:
    return seen if made == seen else made


class StalledDetector:
    """Sets suspects `health down`, publishes them for the steering and destroys the sockets
    that would wait on them."""

    def __init__(
        self, settings: DetectorSettings, state: State, cli: MasterCLI, wake_steering: Callable[[], None] = lambda: None
    ) -> None:
        self.settings = settings
        self.state = state
        self.cli = cli
        self.wake_steering = wake_steering
        self.can_abort = False
        self._current: ServerIndex | None = None
        self._tcp = TcpActivity()
        self._activity: TcpCounters | None = None  # the kernel's TCP counters at the last dump
        # What watched_indexes() last worked from (current, generations, old workers' PIDs), and
        # its answer: at rest it is the same every poll.
        self._seen: tuple[Generation | None, tuple[Generation, ...], frozenset[int]] = (None, (), frozenset())
        self._seen_answer: tuple[ServerIndex, ServerIndex] | None = None
        self._look: asyncio.TimerHandle | None = None  # the at-rest look of the next tick
        self._watched: ServerIndex | None = None  # every running config's servers, merged
        self._watched_shas: set[str] = set()  # the configs merged into it
        # Old workers' own configs, indexed only once one of them has a connect toward a
        # known-dead server it is steered off (the merged index cannot say which config a
        # server is of); dropped when no worker runs them.
        self._by_sha: dict[str, ServerIndex] = {}
        self._first_seen: dict[bytes, float] = {}  # sockid -> monotonic first sight of its stall
        self._rtts: dict[Endpoint, float] = {}  # the slowest smoothed RTT seen lately, per endpoint
        self._held: dict[str, tuple[Suspect, float]] = {}  # key -> (suspect, monotonic last seen stalled)
        self._health_down: set[str] = set()  # suspects set `health down` in the current worker
        self._left_in: set[str] = set()  # suspects the current worker keeps: left_in()
        self._destroyed: set[bytes] = set()
        self._current_fds: dict[int, int] = {}  # the current worker's sockets at the last _owners(): inode -> fd
        self.aborted = 0  # stalled sockets destroyed
        self.idle_closed = 0  # idle pooled connections destroyed

    async def run(self) -> None:
        if not self.settings.enabled:
            log.info("stalled-connection detector off (detector.enabled)")
            self.state.publish_abort(False, "detector.enabled")
            return
        self.can_abort = self.settings.abort and has_net_admin()
        off_because = None if self.can_abort else "no CAP_NET_ADMIN" if self.settings.abort else "detector.abort"
        self.state.publish_abort(self.can_abort, off_because)
        if self.settings.abort and not self.can_abort:
            log.warning("stalled-connection detector: no CAP_NET_ADMIN, stalled sockets are not aborted "
                        "(and idle pooled connections not closed): grant it to the daemon")
        failing = RecurringCondition(log, logging.WARNING, "stalled-connection detector: %s")
        loop = asyncio.get_running_loop()
        work = asyncio.Event()
        try:
            while True:
                try:
                    await self.poll()
                    failing.over("stalled-connection detector: working again")
                except (OSError, CLIError) as exc:
                    failing.happened(exc)
                work.clear()
                self._look_at_next_tick(loop, work)
                await work.wait()
        finally:
            if self._look is not None:
                self._look.cancel()

    def _look_at_next_tick(self, loop: asyncio.AbstractEventLoop, work: asyncio.Event, interval_ms: int = 0) -> None:
        """At the next instant of the shared grid of timers, look whether a poll has anything to
        do; at rest, look again two polls later (within the threshold's floor), the task asleep."""
        poll = self.settings.poll_interval_ms
        at_rest = poll * max(1, min(self.settings.threshold_floor_ms, 2 * poll) // poll)

        def look() -> None:
            if self._at_rest():
                self._look_at_next_tick(loop, work, at_rest)
            else:
                self._look = None
                work.set()

        self._look = loop.call_at(next_tick(loop.time(), interval_ms or poll), look)

    def _at_rest(self) -> bool:
        if self._first_seen or self._held or not self._indexes_unchanged():
            return False
        answer = self._seen_answer
        if answer is None or not answer[1].ports:
            return True  # nothing to watch until the configs change
        return nothing_to_dump(self._activity, self._tcp.read())

    async def watched_indexes(self) -> tuple[ServerIndex, ServerIndex] | None:
        """The current config's servers (the ones `health` commands reach), and those of every
        config a worker runs. Only a config that starts running is indexed and merged in; one
        that stops stays merged until the index has grown to twice the current config's."""
        if self._indexes_unchanged() and self._seen_answer is not None:
            return self._seen_answer
        state = self.state
        seen = state.current, tuple(state.generations.values()), frozenset(state.old_workers)
        self._seen_answer = await self._work_out_indexes()
        self._seen = seen
        return self._seen_answer

    def _indexes_unchanged(self) -> bool:
        state, (current, generations, old) = self.state, self._seen
        return (
            state.current is current
            and len(state.generations) == len(generations)
            and state.old_workers.keys() == old
            and all(map(operator.is_, state.generations.values(), generations))
        )

    async def _work_out_indexes(self) -> tuple[ServerIndex, ServerIndex] | None:
        current = self.state.current
        if current is None:
            return None
        running = {
            g.effective_sha256: g
            for g in sorted(self.state.generations.values(), key=lambda g: g.number)
            if g is current or g.worker_pid in self.state.old_workers
        }
        rebuilt = self._current is None or self._current.sha256 != current.effective_sha256
        if rebuilt:
            self._current = await sliced(ServerIndex.building(current))
        now = self._current
        self._by_sha = {sha: i for sha, i in self._by_sha.items() if sha in running}
        watched = self._watched
        if len(running) == 1:
            self._watched, self._watched_shas = now, {now.sha256}
            return now, now
        if watched is None or len(watched.by_endpoint) > 2 * len(now.by_endpoint) + 1000:
            watched, self._watched_shas = now, {now.sha256}
        added = [sha for sha in running if sha not in self._watched_shas]
        if added:
            indexes = [watched]
            for sha in added:
                indexes.append(now if sha == now.sha256 else await sliced(ServerIndex.building(running[sha])))
            watched = await sliced(merging(indexes))
            self._watched_shas.update(added)
        self._watched = watched
        if rebuilt or added:
            give_back_free_heap()  # an index of every server, built after each reload
        return now, watched

    async def poll(self) -> None:
        found_indexes = await self.watched_indexes()
        current = self.state.current
        if found_indexes is None or current is None or not found_indexes[1].ports:
            return
        now_index, index = found_indexes
        activity = self._tcp.read()
        if nothing_to_dump(self._activity, activity) and not self._first_seen and not self._held:
            return
        self._activity = activity
        now = time.monotonic()
        listed = [
            s for family in index.families
            for s in tcp_sockets(family, (TCP_SYN_SENT, TCP_ESTABLISHED), index.ports, info=True)
            if (s.dst, s.dport) in index.by_endpoint
        ]
        stalls: list[Stall] = []
        seen: dict[bytes, float] = {}
        for sock in listed:
            if sock.state == TCP_ESTABLISHED and sock.rtt_ms and sock.retrans == 0:
                endpoint = (sock.dst, sock.dport)
                self._rtts[endpoint] = max(sock.rtt_ms, 0.9 * self._rtts.get(endpoint, 0.0))
            first = self._first_seen.get(sock.sockid, now)
            stall = stall_of(sock, (now - first) * 1000)
            if stall is not None:
                seen[sock.sockid] = first
                stalls.append(stall)
        self._first_seen = seen
        if not stalls and not self._held:
            return  # at rest: nothing stalled, nothing suspect
        owners = self._owners(current.worker_pid)
        stalls = [s for s in stalls if s.socket.inode in owners]
        found = suspects(stalls, index.by_endpoint, self._rtts, self.settings.threshold_floor_ms, time.time())
        new = [s for k, s in found.items() if k not in self._held]
        for key, suspect in found.items():
            kept = self._held.get(key)
            self._held[key] = (kept[0] if kept is not None else suspect, now)
        hold = self.settings.hold_s
        ended = [k for k, (_, last) in self._held.items() if k not in found and now - last > hold]
        for key in ended:
            del self._held[key]
            log.info("%s: no longer suspect (no stalled socket for %gs)", key, hold)
        if new or ended:
            for suspect in new:
                log.warning("%s: suspect: %s stalled toward %s:%d", suspect.key, suspect.why, *suspect.endpoint)
            left = left_in((k for k in self._held if k in now_index.keys), now_index.backends, self.state.dead_servers)
            for key in sorted(left - self._left_in):
                log.warning("%s: left in the current worker: every other server of its backend is out", key)
            self._left_in = left
            self._publish()
        # Abort before `health down`: HAProxy waits a turn-around (up to 1 s) before a retry
        # when the backend is left with one active server, and not while the suspect still
        # counts; a redispatched retry avoids the server it failed on either way.
        if self.can_abort and (self._held or stalls):
            stalled_pids = {owners.get(s.socket.inode) for s in stalls}
            steered = {pid: frozenset(r.steered) for pid, r in self.state.old_workers.items() if pid in stalled_pids}
            own = await self._own_indexes(stalls, owners, current.worker_pid, steered, index, now_index)
            aborted = self._abort(listed, stalls, owners, current.worker_pid, index, steered, own)
        else:
            aborted = []
        if current.worker_pid is not None:
            # A server taken out with a check comes back after `rise` passes; one without, only if set up again.
            unchecked = [
                k for k in ended if k in self._health_down and k in now_index.keys and k not in now_index.checked
            ]
            self._health_down.difference_update(ended)
            if unchecked:
                await self._set_health(current.worker_pid, unchecked, "up")
            here = [s.key for s in new if s.key in now_index.keys and s.key not in self._left_in]
            if here:
                # HAProxy decides whether a retry waits its turn-around (1 s, when the backend has
                # one active server left) as it handles the connect error, and closes the socket
                # in that step: a `health down` read before it would leave one.
                pid = current.worker_pid
                await self._until_closed(pid, (s.inode for s in aborted if owners.get(s.inode) == pid))
                await self._set_health(current.worker_pid, here, "down")
                self._health_down.update(here)
                self.wake_steering()
            if not self.can_abort:
                await self._send_back(current.worker_pid, stalls, owners, index)

    def _owners(self, current_pid: int | None) -> dict[int, int]:
        """{socket inode: worker PID}: read only when something is stalled."""
        owners = {inode: pid for pid in self.state.old_workers for inode in socket_inodes(pid)}
        self._current_fds = {}
        if current_pid is not None:
            self._current_fds = socket_inodes(current_pid)
            owners.update(dict.fromkeys(self._current_fds, current_pid))
        return owners

    async def _until_closed(self, pid: int, inodes: Iterable[int]) -> None:
        """Until worker `pid` has closed the sockets destroyed under it (or ABORT_SETTLE_S)."""
        left = {i: self._current_fds[i] for i in inodes if i in self._current_fds}
        deadline = time.monotonic() + ABORT_SETTLE_S
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
            left = still_open(pid, left)

    async def _set_health(self, pid: int, keys: list[str], health: str) -> None:
        commands = ";".join(f"set server {ServerKey.parse(key)} health {health}" for key in keys)  # parse() validates
        answers = await self.cli.on(pid, commands, timeout=2)
        if answers.strip():
            log.warning("worker %d: set server ... health %s answered: %s", pid, health, answers.strip())

    async def _send_back(self, pid: int, stalls: list[Stall], owners: dict[int, int], index: ServerIndex) -> None:
        """Without the abort: end the current worker's handed-off requests still connecting to a
        suspect it took out, so their old workers send them again (haproxy/handoff.py's
        rescue_lines) and the current worker balances them over the servers it has left.
        Nothing reached the server yet; a request of its own would fail, so it waits."""
        taken_out = frozenset(k for k in self._held if k not in self._left_in)
        if not any(
            s.why == "connect" and owners.get(s.socket.inode) == pid
            and taken_out.intersection(index.by_endpoint.get(s.endpoint, ()))
            for s in stalls
        ):
            return
        try:
            ended = await end_stuck_streams(self.cli, pid, taken_out, HANDOFF_FRONTEND)
        except (CLIError, OSError) as exc:
            log.warning("worker %d: cannot end handed-off requests stuck on suspects: %s", pid, exc)
            return
        if ended:
            log.info("worker %d: ended %d handed-off requests connecting to suspects; their old workers "
                     "send them again (unless `retry-on none`)", pid, ended)

    async def _own_indexes(
        self, stalls: list[Stall], owners: dict[int, int], current_pid: int | None,
        steered: dict[int, frozenset[str]], index: ServerIndex, now_index: ServerIndex,
    ) -> dict[int, dict[Endpoint, tuple[str, ...]]]:
        """Each old worker's own config's servers per endpoint, for those with a connect toward
        an endpoint where some server is known dead and steered off in it (to_abort's "dead")."""
        dead = self.state.dead_servers
        latest = {g.worker_pid: g for g in sorted(self.state.generations.values(), key=lambda g: g.number)}
        wanted: dict[int, Generation] = {}
        for stall in stalls:
            pid = owners.get(stall.socket.inode)
            if pid is None or pid == current_pid or pid in wanted or stall.why != "connect":
                continue
            off = steered.get(pid)
            generation = latest.get(pid)
            if not off or generation is None:
                continue
            if any(k in dead and k in off for k in index.by_endpoint.get(stall.endpoint, ())):
                wanted[pid] = generation
        own: dict[int, dict[Endpoint, tuple[str, ...]]] = {}
        for pid, generation in wanted.items():
            sha = generation.effective_sha256
            if sha != now_index.sha256 and sha not in self._by_sha:
                self._by_sha[sha] = await sliced(ServerIndex.building(generation))
            own[pid] = (now_index if sha == now_index.sha256 else self._by_sha[sha]).by_endpoint
        return own

    def _abort(
        self, listed: list[DiagSocket], stalls: list[Stall], owners: dict[int, int], current_pid: int | None,
        index: ServerIndex, steered: dict[int, frozenset[str]], own: dict[int, dict[Endpoint, tuple[str, ...]]],
    ) -> list[DiagSocket]:
        """Destroy the stalled sockets to_abort() names, and idle pooled connections to suspects;
        the stalled ones destroyed."""
        # A suspect left in is still routed: its connections are the backend's only way.
        held_at = {s.endpoint for key, (s, _) in self._held.items() if key not in self._left_in}
        targets: list[tuple[DiagSocket, str]] = [
            (stall.socket, "aborted" if why == "suspect" else "aborted (known dead)")
            for stall, why in to_abort(stalls, owners, index.by_endpoint, self._held.keys(), current_pid,
                                       steered, own, self.state.dead_servers, self._left_in)
        ]
        for sock in listed:
            if (sock.dst, sock.dport) in held_at and idle(sock) and sock.inode in owners:
                targets.append((sock, "idle"))
        destroyed: list[DiagSocket] = []
        for sock, kind in targets:
            if sock.sockid in self._destroyed:
                continue
            try:
                destroy(sock)
            except SockDiagError as exc:
                log.debug("SOCK_DESTROY %s:%d -> %s:%d: %s", sock.src, sock.sport, sock.dst, sock.dport, exc)
                continue
            self._destroyed.add(sock.sockid)
            if kind == "idle":
                self.idle_closed += 1
            else:
                self.aborted += 1
                destroyed.append(sock)
            log.info("worker %d: %s socket %s:%d -> %s:%d destroyed", owners[sock.inode], kind, sock.src,
                     sock.sport, sock.dst, sock.dport)
        if len(self._destroyed) > 10_000:
            self._destroyed.clear()
        if targets:
            self.state.publish_socket_aborts(self.aborted, self.idle_closed)
        return destroyed

    def _publish(self) -> None:
        self.state.publish_suspects({
            key: SuspectServer(
                key, f"{s.endpoint[0]}:{s.endpoint[1]}", s.why, datetime.fromtimestamp(s.since, UTC),
                left_in=key in self._left_in,
            )
            for key, (s, _) in self._held.items()
        })
        self.wake_steering()
