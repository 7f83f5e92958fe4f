"""What the daemon knows: a field is written only by a `publish_*` method here, each called by the
component that owns that fact; status, the page and /metrics only read. Event loop only, no I/O."""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from .haproxy.config import Config

# unknown: HAProxy did not confirm within reload.timeout_s; `show proc` settles it later.
ReloadResult = Literal["ok", "failed", "invalid", "skipped_unchanged", "runtime_applied", "unknown"]
PushStateName = Literal["ok", "pending", "failed"]
# Points each of the status page's charts keeps: memory stays bounded however long the daemon runs.
CHART_POINTS = 240
chart_series = functools.partial(deque, maxlen=CHART_POINTS)


def utcnow() -> datetime:
    return datetime.now(UTC)


def rfc3339(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Generation:
    """One loaded config: generation N is what the worker started by the N-th reload runs."""

    number: int
    model: Config  # the effective config this generation's worker runs
    effective_sha256: str
    rendered_sha256: str
    started_at: datetime
    worker_pid: int | None = None
    inputs_sha256: str | None = None  # digest of the files in haproxy.watch it was loaded with


@dataclass
class ReloadRecord:
    at: datetime
    result: ReloadResult
    duration_ms: float
    error: str | None = None


@dataclass
class ReloadStats:
    ok: int = 0
    failed: int = 0
    invalid: int = 0
    skipped_unchanged: int = 0
    runtime_applied: int = 0
    unknown: int = 0
    last: ReloadRecord | None = None
    history: list[ReloadRecord] = field(default_factory=list)  # newest last, bounded
    chart: deque[ReloadRecord] = field(default_factory=chart_series)  # the page's chart, newest last

    HISTORY = 20

    def record(self, result: ReloadResult, duration_ms: float, error: str | None = None) -> ReloadRecord:
        entry = ReloadRecord(utcnow(), result, duration_ms, error)
        setattr(self, result, getattr(self, result) + 1)
        self.last = entry
        self.history.append(entry)
        del self.history[: -self.HISTORY]
        self.chart.append(entry)
        return entry


@dataclass
class PushState:
    state: PushStateName = "pending"
    at: datetime | None = None
    error: str | None = None


@dataclass(frozen=True)
class PushNews:
    """How one old worker's push went, as the steering publishes it."""

    result: PushStateName
    error: str | None = None
    steered: Sequence[str] = ()  # with "ok": the "backend/server" it is kept away from (the plan's, not copied)


@dataclass(frozen=True)
class SuspectServer:
    """A server the stalled-connection detector holds to be unreachable (steering/detector.py)."""

    key: str  # "backend/server"
    endpoint: str  # "address:port"
    why: str  # "connect": a connect stalled in SYN-SENT; "retransmit": data sent, never acknowledged
    since: datetime  # when its oldest stalled socket stalled
    left_in: bool = False  # every other server of its backend is out: routed still (detector.left_in)


@dataclass
class OldWorker:
    pid: int
    generation: int | None  # None when adopted and its config could not be recovered
    started_at: datetime | None
    rss_bytes: int | None = None
    connections: int | None = None
    steered: list[str] = field(default_factory=list)  # "backend/server" steered away from
    push: PushState = field(default_factory=PushState)
    handed_off: int = 0  # backends whose requests it hands to the current worker (confirmed)

    def age_s(self, now: datetime | None = None) -> float | None:
        if self.started_at is None:
            return None
        return ((now or utcnow()) - self.started_at).total_seconds()


@dataclass
class DurationHistogram:
    """Cumulative-bucket histogram of seconds, in Prometheus's shape, kept without a registry."""

    BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
    counts: list[int] = field(default_factory=lambda: [0] * len(DurationHistogram.BOUNDS))  # per bound, cumulative
    count: int = 0  # the +Inf bucket
    sum: float = 0.0
    recent: deque[tuple[datetime, float]] = field(default_factory=chart_series)  # (when, seconds), newest last

    def observe(self, seconds: float) -> None:
        self.recent.append((utcnow(), seconds))
        for i, bound in enumerate(self.BOUNDS):
            if seconds <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += seconds


@dataclass
class Convergence:
    """Whether the current worker runs the rendered config and the watched files, and since when not."""

    unconverged_since: datetime | None = field(default_factory=utcnow)  # None while converged
    reason: str | None = "starting"
    # A passing failure: /readyz says 503 once it lasts. False when the config itself is the problem:
    # HAProxy serves the last good one, and a bad config for the fleet must not take every node out.
    transient: bool = True
    attempts: int = 0  # attempts since the node last converged
    next_attempt_at: datetime | None = None

    @property
    def converged(self) -> bool:
        return self.unconverged_since is None

    def unconverged_s(self, now: datetime) -> float:
        if self.unconverged_since is None:
            return 0.0
        return max(0.0, (now - self.unconverged_since).total_seconds())

    def reached(self) -> None:
        self.unconverged_since = self.next_attempt_at = self.reason = None
        self.transient, self.attempts = True, 0

    def missed(self, reason: str, transient: bool, now: datetime | None = None) -> None:
        if self.unconverged_since is None:
            self.unconverged_since = now or utcnow()
        self.reason = reason
        self.transient = transient


@dataclass(frozen=True)
class PendingRemoval:
    """A server gone from the rendered config that a worker still holds (`del server` is refused while
    connections are attached): in maint, retried while that worker is current (haproxy/runtime/hook.py)."""

    key: str  # backend/server
    worker_pid: int
    since: datetime
    since_monotonic: float
    tries: int = 0
    last_answer: str = ""
    next_try_monotonic: float = 0.0
    sessions_shut_down: bool = False
    endpoint: tuple[str, int] | None = None  # the server's address and port before its removal


@dataclass
class State:
    """Everything /status, /metrics and the page show."""

    supervisor_pid: int = field(default_factory=os.getpid)
    started_at: datetime = field(default_factory=utcnow)  # wall clock, for status's pure uptime
    haproxy_binary: str = "haproxy"
    haproxy_version: str | None = None
    master_pid: int | None = None
    master_restarts: int = 0
    master_up: bool = False
    generations: dict[int, Generation] = field(default_factory=dict)
    current_generation: int | None = None
    old_workers: dict[int, OldWorker] = field(default_factory=dict)
    pending_removals: Mapping[str, PendingRemoval] = field(default_factory=dict)  # by backend/server
    reloads: ReloadStats = field(default_factory=ReloadStats)
    rendered_sha256: str | None = None
    last_good_sha256: str | None = None
    operator_dead: set[str] = field(default_factory=set)  # "backend/server" marked by an operator
    dead_servers: set[str] = field(default_factory=set)  # every known-dead server, any reason
    suspect_servers: Mapping[str, SuspectServer] = field(default_factory=dict)  # by "backend/server"
    # Whether the detector destroys stalled sockets, and why not when it does not.
    detector_aborts: bool = False
    detector_abort_off: str | None = None
    stalled_aborted: int = 0  # stalled sockets to suspects destroyed
    idle_closed: int = 0  # idle pooled connections to suspects destroyed
    push_failures: int = 0
    server_state_reads: int = 0  # full `show servers state` reads of a worker by the steering
    # The master's stderr is the daemon's FIFO: server state changes are heard as they happen.
    server_events: bool = False
    push_duration: DurationHistogram = field(default_factory=DurationHistogram)
    convergence: Convergence = field(default_factory=Convergence)
    master_socket_ok: bool = True  # False while the master's socket is missing from runtime_dir
    # Best-effort files whose last write failed, with the error; and how many such writes failed.
    write_failing: dict[str, str] = field(default_factory=dict)
    write_failures: int = 0
    status_listener_down: str | None = None  # why the status API cannot serve; None: it serves
    event_loop_lag_s: float = 0.0  # the worst delay of the event loop lately (eventloop.LoopLag)
    old_worker_counts: deque[tuple[datetime, int]] = field(default_factory=chart_series)  # (when, old workers)

    # A steady count is noted again after this long, so its line reaches the present.
    OLD_WORKER_SAMPLE_S = 30.0

    @property
    def current(self) -> Generation | None:
        if self.current_generation is None:
            return None
        return self.generations.get(self.current_generation)

    def note_old_workers(self, now: datetime | None = None) -> None:
        """Note how many old workers are alive, for the page's chart, when it changed or after a while."""
        now = now or utcnow()
        count = len(self.old_workers)
        if self.old_worker_counts:
            at, last = self.old_worker_counts[-1]
            if last == count and (now - at).total_seconds() < self.OLD_WORKER_SAMPLE_S:
                return
        self.old_worker_counts.append((now, count))

    # ------------------------------------------------------------ publish, by owner
    # The reloader's.
    def publish_rendered(self, sha256: str) -> None:
        self.rendered_sha256 = sha256

    def publish_reload(self, result: ReloadResult, duration_ms: float, error: str | None = None) -> ReloadRecord:
        return self.reloads.record(result, duration_ms, error)

    def publish_converged(self) -> None:
        self.convergence.reached()

    def publish_unconverged(self, reason: str, transient: bool) -> None:
        self.convergence.missed(reason, transient)

    def publish_next_attempt(self, at: datetime | None, attempts: int | None = None) -> None:
        self.convergence.next_attempt_at = at
        if attempts is not None:
            self.convergence.attempts = attempts

    def publish_master_socket(self, ok: bool) -> None:
        self.master_socket_ok = ok

    # The generations book's.
    def publish_generation(self, generation: Generation, *, current: bool = False) -> None:
        """A generation, new or a new value; `current` makes it current and its config the last good one."""
        self.generations[generation.number] = generation
        if current:
            self.current_generation = generation.number
            self.last_good_sha256 = generation.effective_sha256

    def publish_pruned(self, numbers: Iterable[int]) -> list[Generation]:
        return [g for n in numbers if (g := self.generations.pop(n, None)) is not None]

    # The master process's.
    def publish_master(self, pid: int | None, server_events: bool = False) -> None:
        self.master_pid, self.master_up, self.server_events = pid, pid is not None, server_events

    def publish_master_restart(self) -> int:
        self.master_restarts += 1
        return self.master_restarts

    # The steering's.
    def publish_old_workers(
        self, generations: Mapping[int, int | None], started: Mapping[int, datetime | None]
    ) -> None:
        """The old workers `show proc` lists, with their generation; `started`: when new ones started."""
        for pid in [pid for pid in self.old_workers if pid not in generations]:
            del self.old_workers[pid]
        for pid, generation in generations.items():
            record = self.old_workers.get(pid)
            if record is None:
                self.old_workers[pid] = OldWorker(pid, generation, started.get(pid))
            elif record.generation is None:
                record.generation = generation
        self.note_old_workers()

    def publish_pushes(self, pushes: Mapping[int, PushNews], failures: int = 0) -> None:
        self.push_failures += failures
        for pid, news in pushes.items():
            record = self.old_workers.get(pid)
            if record is None:
                continue
            if news.result == "ok":
                record.steered = news.steered if isinstance(news.steered, list) else list(news.steered)
                if record.push.state == "ok":
                    continue  # keep the time of the push that made it so
            record.push = PushState(news.result, utcnow() if news.result != "pending" else record.push.at, news.error)

    def publish_handed_off(self, counts: Mapping[int, int]) -> None:
        for pid, count in counts.items():
            record = self.old_workers.get(pid)
            if record is not None:
                record.handed_off = count

    def publish_push_round(self, duration_s: float) -> None:
        self.push_duration.observe(duration_s)

    def publish_old_worker_stats(self, stats: Mapping[int, tuple[int | None, int | None]]) -> None:
        """Old workers' connections and resident bytes (None: unknown, the last value stays)."""
        for pid, (connections, rss_bytes) in stats.items():
            record = self.old_workers.get(pid)
            if record is not None:
                record.connections = connections if connections is not None else record.connections
                record.rss_bytes = rss_bytes if rss_bytes is not None else record.rss_bytes

    def publish_dead_servers(self, keys: Iterable[str]) -> None:
        self.dead_servers = set(keys)

    def publish_operator_dead(self, key: str, dead: bool) -> None:
        if dead:
            self.operator_dead.add(key)
        else:
            self.operator_dead.discard(key)

    def publish_state_reads(self, count: int) -> None:
        self.server_state_reads += count

    # The stalled-connection detector's.
    def publish_suspects(self, suspects: Mapping[str, SuspectServer]) -> None:
        self.suspect_servers = dict(suspects)

    def publish_abort(self, aborts: bool, off_because: str | None) -> None:
        self.detector_aborts, self.detector_abort_off = aborts, off_because

    def publish_socket_aborts(self, aborted: int, idle_closed: int) -> None:
        self.stalled_aborted, self.idle_closed = aborted, idle_closed

    # One owner each: the runtime applier, a best-effort file's writer, the status server,
    # the daemon (`haproxy -v`), the loop-lag monitor.
    def publish_pending_removals(self, removals: Mapping[str, PendingRemoval]) -> None:
        self.pending_removals = dict(removals)

    def publish_write(self, what: str, error: str | None) -> None:
        if error is None:
            self.write_failing.pop(what, None)
        else:
            self.write_failing[what] = error
            self.write_failures += 1

    def publish_status_listener(self, down: str | None) -> None:
        self.status_listener_down = down

    def publish_haproxy_version(self, version: str | None) -> None:
        self.haproxy_version = version

    def publish_event_loop_lag(self, lag_s: float) -> None:
        self.event_loop_lag_s = lag_s
