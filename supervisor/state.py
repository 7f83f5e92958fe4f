"""What the daemon knows, in one place: written by the components, read by status.

Plain mutable dataclasses, touched only from the event loop, so no locks. The
status app renders them to JSON and Prometheus; nothing here does I/O.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from .haproxy.config import Config

# unknown: HAProxy did not confirm within reload.timeout_s; `show proc` settles it later.
ReloadResult = Literal["ok", "failed", "invalid", "skipped_unchanged", "runtime_applied", "unknown"]
PushStateName = Literal["ok", "pending", "failed"]
# Points each of the status page's charts keeps: memory stays bounded however long the daemon runs.
CHART_POINTS = 240


def chart_series() -> deque:
    return deque(maxlen=CHART_POINTS)


def utcnow() -> datetime:
    return datetime.now(UTC)


def rfc3339(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Generation:
    """One loaded config: generation N is what the worker started by the N-th reload runs."""

    number: int
    model: Config  # the effective config this generation's worker runs
    effective_sha256: str
    rendered_sha256: str
    started_at: datetime
    worker_pid: int | None = None


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


@dataclass
class OldWorker:
    pid: int
    generation: int | None  # None when adopted and its config could not be recovered
    started_at: datetime | None
    rss_bytes: int | None = None
    connections: int | None = None
    steered: list[str] = field(default_factory=list)  # "backend/server" steered away from
    push: PushState = field(default_factory=PushState)

    def age_s(self, now: datetime | None = None) -> float | None:
        if self.started_at is None:
            return None
        return ((now or utcnow()) - self.started_at).total_seconds()


@dataclass
class DurationHistogram:
    """Cumulative-bucket histogram of seconds, in Prometheus's shape, kept without a registry."""

    bounds: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
    counts: list[int] = field(default_factory=list)  # per bound, cumulative; +Inf is `count`
    count: int = 0
    sum: float = 0.0
    recent: deque[tuple[datetime, float]] = field(default_factory=chart_series)  # (when, seconds), newest last

    def observe(self, seconds: float) -> None:
        self.recent.append((utcnow(), seconds))
        if not self.counts:
            self.counts = [0] * len(self.bounds)
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += seconds


@dataclass
class Convergence:
    """Whether the current worker runs what the rendered config asks for, and since when not.

    The goal is the effective config built from the rendered config (and the digest of the
    watched files); the truth is what `show proc` says the current worker runs. While the two
    differ the reloader keeps trying, with backoff (docs/operating.md, "What happens when").
    """

    unconverged_since: datetime | None = field(default_factory=utcnow)  # None while converged
    reason: str | None = "starting"
    # A passing failure (HAProxy unreachable, the disk, file descriptors, a pending change):
    # retried quickly, and /readyz says 503 once it lasts. False when the config itself is the
    # problem (invalid, or refused by HAProxy): HAProxy serves the last good config, and a bad
    # config rendered for the whole fleet must not take every node out of its load balancer.
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
        self.unconverged_since = None
        self.reason = None
        self.transient = True
        self.attempts = 0
        self.next_attempt_at = None

    def missed(self, reason: str, transient: bool, now: datetime | None = None) -> None:
        if self.unconverged_since is None:
            self.unconverged_since = now or utcnow()
        self.reason = reason
        self.transient = transient


@dataclass
class PendingRemoval:
    """A server the rendered config no longer has that the current worker still holds, because
    `del server` is refused while connections are attached to it. It is in maint at the
    placeholder address, so it routes nothing; `del server` is retried in the background
    (haproxy/runtime/pending.py) for as long as that worker is the current one."""

    key: str  # backend/server
    worker_pid: int
    since: datetime
    since_monotonic: float
    tries: int = 0
    last_answer: str = ""
    next_try_monotonic: float = 0.0
    sessions_shut_down: bool = False


@dataclass
class State:
    """Everything /status, /metrics and the page show."""

    supervisor_pid: int = field(default_factory=os.getpid)
    started_monotonic: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=utcnow)  # wall clock, for status's pure uptime
    haproxy_binary: str = "haproxy"
    haproxy_version: str | None = None
    master_pid: int | None = None
    master_restarts: int = 0
    master_up: bool = False
    generations: dict[int, Generation] = field(default_factory=dict)
    current_generation: int | None = None
    old_workers: dict[int, OldWorker] = field(default_factory=dict)
    pending_removals: dict[str, PendingRemoval] = field(default_factory=dict)  # by backend/server
    reloads: ReloadStats = field(default_factory=ReloadStats)
    rendered_path: str | None = None
    rendered_sha256: str | None = None
    effective_path: str | None = None
    last_good_sha256: str | None = None
    operator_dead: set[str] = field(default_factory=set)  # "backend/server" marked by an operator
    dead_servers: set[str] = field(default_factory=set)  # every known-dead server, any reason
    push_failures: int = 0
    server_state_reads: int = 0  # full `show servers state` reads of a worker by the steering
    # The master's stderr is the daemon's FIFO: server state changes are heard as they happen.
    server_events: bool = False
    push_duration: DurationHistogram = field(default_factory=lambda: DurationHistogram())
    convergence: Convergence = field(default_factory=Convergence)
    # False while the master's socket is missing from runtime_dir (deleted under us): the daemon
    # cannot reach HAProxy until it has recreated runtime_dir and made the master rebind it.
    master_socket_ok: bool = True
    event_loop_lag_s: float = 0.0  # the worst delay of the event loop lately (looplag.py)
    old_worker_counts: deque[tuple[datetime, int]] = field(default_factory=chart_series)  # (when, old workers)

    # A steady count is noted again after this long, so its line reaches the present.
    OLD_WORKER_SAMPLE_S = 30.0

    @property
    def current(self) -> Generation | None:
        if self.current_generation is None:
            return None
        return self.generations.get(self.current_generation)

    def note_old_workers(self, now: datetime | None = None) -> None:
        """Note how many old workers are alive, for the page's chart: when it changed, or a while
        after the last note."""
        now = now or utcnow()
        count = len(self.old_workers)
        if self.old_worker_counts:
            at, last = self.old_worker_counts[-1]
            if last == count and (now - at).total_seconds() < self.OLD_WORKER_SAMPLE_S:
                return
        self.old_worker_counts.append((now, count))

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_monotonic

    @property
    def ready(self) -> bool:
        """A current worker runs the last good config."""
        current = self.current
        return (
            self.master_up
            and current is not None
            and current.worker_pid is not None
            and current.effective_sha256 == self.last_good_sha256
        )
