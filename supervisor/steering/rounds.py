"""The push rounds: every map that differs from its plan pushed at once, read back to verify a push
and repair drift, failures backed off. Only PushRounds changes a WorkerRecord."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from ..haproxy.api import CLIError, MasterCLI
from ..settings import Settings
from ..state import PushNews, PushStateName, State
from .live import LiveRead
from .mapdiff import BackendDelta, backend_delta
from .plan import Entries, Steering
from .push import (
    GONE,
    Outgoing,
    PushOutcome,
    Steered,
    end_stuck_streams,
    map_difference,
    outgoing,
    read_back,
    steer,
    tidy,
)

log = logging.getLogger("supervisor.steering")


@dataclass
class WorkerRecord:
    pid: int
    generation: int | None
    current: bool = False
    held: Mapping[str, Entries] | None = None  # its map per backend, as pushed or read; None: read it
    wanted: Steering | None = None  # what it needs; None: leave its map alone
    pending: set[str] | None = None  # backends where held may differ from wanted; None: any
    unusable: frozenset[str] | None = None  # servers it sees down itself; None: ask it
    unusable_at: float = 0.0  # monotonic, when it was last asked
    pushes: int = 0  # moves at the start and the end of a push: a read-back overlapping one proves nothing
    verify: bool = True  # read its map back (after a push, or for a reconcile)
    verified_at: float = 0.0  # monotonic
    unread: int = 0  # read-backs in a row without a whole answer
    failures: int = 0
    retry_at: float = 0.0  # monotonic
    swept: frozenset[str] = field(default_factory=frozenset)  # dead set whose stuck streams were ended

    def want(self, steering: Steering | None) -> None:
        """Take a new plan, noting which backends can now differ from what its map holds."""
        self.pending = pending_after(self.wanted, steering, self.pending)
        self.wanted = steering

    def deltas(self) -> list[BackendDelta] | None:
        return map_deltas(self.held, self.wanted, self.pending)

    def in_sync(self) -> bool:
        return self.wanted is not None and self.deltas() == []


def shared_set(unusable: frozenset[str], workers: Iterable[WorkerRecord]) -> frozenset[str]:
    """`unusable`, or an equal set another worker holds already: workers that became old one after
    another mostly see the same servers down, and each read made its own set of its own keys.
    Sets of other sizes are told apart at once."""
    for worker in workers:
        if worker.unusable is not None and worker.unusable is not unusable and worker.unusable == unusable:
            return worker.unusable
    return unusable


def pending_after(before: Steering | None, after: Steering | None, pending: set[str] | None) -> set[str] | None:
    """The backends where a worker's map may differ from its plan once it takes `after` (None: any)."""
    if after is None or before is None or pending is None:
        return None
    if after.source != before.source:
        return None  # another config, or other servers it skips: compare every backend
    if after.previous == before.basis:
        return pending | after.changed
    if after.basis != before.basis:
        return None
    return pending


def map_deltas(
    held: Mapping[str, Entries] | None, wanted: Steering | None, pending: Collection[str] | None
) -> list[BackendDelta] | None:
    """Per backend, looking only at `pending` (None: every backend). None: the map is unknown,
    or nothing is wanted."""
    if held is None or wanted is None:
        return None
    parts = wanted.parts
    backends = pending if pending is not None else held.keys() | parts.keys()
    # Plans share the entries of the backends they did not change, so most compare by identity.
    return [
        backend_delta(h or (), p or ())
        for b in backends
        if (h := held.get(b)) is not (p := parts.get(b)) and h != p
    ]


@dataclass(frozen=True)
class Ahead:
    """A push worked out before it was due: good while the worker holds `held` and wants `wanted`."""

    held: Mapping[str, Entries]
    wanted: Steering
    deltas: list[BackendDelta]
    going: Outgoing | None  # None: no change


class PushRounds:
    """The one shell that changes WorkerRecords; their push records reach State once per step."""

    # Every push is read back at once; this re-reading only repairs what a third party changed.
    RECONCILE_INTERVAL_S = 30.0
    MAX_BACKOFF_S = 5.0
    UNREAD_LIMIT = 3  # read-backs in a row cut off (the master re-executing) before one counts as failed

    def __init__(self, settings: Settings, state: State, cli: MasterCLI) -> None:
        self.settings = settings
        self.state = state
        self.cli = cli
        self.map_path = str(settings.haproxy.steer_map)
        self.last_push: dict[str, float] = {}  # figures of the last push round, for benchmarks
        self._news: dict[int, PushNews] = {}  # push records not published yet
        self._failures = 0  # failures not published yet
        self._shared: tuple[LiveRead, frozenset[str]] | None = None  # a read's unusable set, as shared

    def track(
        self,
        workers: dict[int, WorkerRecord],
        generations: Mapping[int, int | None],
        current_pid: int | None,
        live: LiveRead | None,
    ) -> None:
        for pid in [pid for pid in workers if pid not in generations]:
            del workers[pid]
        for pid, generation in generations.items():
            worker = workers.setdefault(pid, WorkerRecord(pid, generation))
            if worker.generation is None:
                worker.generation = generation
            worker.current = pid == current_pid
            if live is not None and live.pid == pid and (worker.current or worker.unusable is None):
                # An old worker starts from its view as last seen while it was current: health
                # checks stop in an old worker, so that view barely changes (a reconcile refreshes it).
                if self._shared is None or self._shared[0] is not live:  # once a read, not every round
                    self._shared = (live, shared_set(live.states.unusable, workers.values()))
                worker.unusable = self._shared[1]

    def want(self, worker: WorkerRecord, steering: Steering | None, refused: str | None = None) -> None:
        """A worker's plan (None: leave its map alone); `refused`: why it cannot be steered."""
        worker.want(steering)
        if refused is not None:
            self.record(worker, "failed", refused)

    def own_views(self, workers: Mapping[int, WorkerRecord], reads: Mapping[int, LiveRead]) -> None:
        """Old workers' own views (read_unusable's answers)."""
        for pid, read in reads.items():
            worker = workers.get(pid)
            if worker is not None:
                worker.unusable, worker.unusable_at = shared_set(read.states.unusable, workers.values()), read.at

    def server_changed(self, worker: WorkerRecord) -> None:
        worker.unusable = None

    async def push_all(self, workers: Collection[WorkerRecord], ahead: Mapping[int, Ahead] | None = None) -> None:
        """Push to every worker whose map differs from its plan (and is not backing off), all at
        once: every worker steered first, then every map tidied."""
        started = time.monotonic()
        due: list[tuple[WorkerRecord, asyncio.Task[Steered]]] = []
        try:
            for worker in list(workers):
                wanted = worker.wanted
                if wanted is None:
                    continue
                try:
                    deltas, going = self._worked_out(worker, wanted, (ahead or {}).get(worker.pid))
                except ValueError as exc:  # an entry or a map path that no CLI line can carry
                    self.failed(worker, str(exc))
                    continue
                if deltas == []:
                    worker.held, worker.pending = wanted.parts, set()
                    self.record(worker, "ok")
                elif worker.retry_at <= started:
                    self.record(worker, "pending")
                    if worker.held is not None:
                        worker.held, worker.pushes = None, worker.pushes + 1  # in between until every answer is in
                    steering = steer(self.cli, self.map_path, worker.pid, wanted, going)
                    due.append((worker, asyncio.ensure_future(steering)))
                    # Its lines go out while the next worker's changes are worked out: with fifty
                    # old workers, HAProxy relays the first pushes instead of waiting for the last plan.
                    await asyncio.sleep(0)
            self.publish()
            steered = await asyncio.gather(*(task for _, task in due))
            # The master relays a few lines at a time: one worker's tidy-up sent while another
            # still waits for its routing would delay that worker's steering.
            outcomes = await asyncio.gather(*(tidy(self.cli, w.pid, s) for (w, _), s in zip(due, steered, strict=True)))
        except BaseException:
            for _, task in due:
                task.cancel()
            raise
        if not due:
            return
        steered_at: list[float] = []
        changes = 0
        for (worker, _), outcome in zip(due, outcomes, strict=True):
            self._apply_push(worker, outcome)
            changes += outcome.sent
            if outcome.steered_at is not None:
                steered_at.append(outcome.steered_at)
        if steered_at:
            self.state.publish_push_round(time.monotonic() - started)
            self.last_push = {
                "workers": len(steered_at),
                "changes": changes,
                "steered_s": max(steered_at) - started,
                "steered_at": max(steered_at),  # monotonic, when the last one was answered
            }
        self.publish()

    async def work_ahead(
        self, workers: Mapping[int, WorkerRecord], plans: Mapping[int, Steering]
    ) -> dict[int, Ahead]:
        """Each worker's push to its next plan, worked out while `haproxy -c` checks the next
        config: push_all takes it if neither changed meanwhile."""
        found: dict[int, Ahead] = {}
        for pid, plan in plans.items():
            worker = workers.get(pid)
            if worker is None or worker.held is None or not plan.digest.guarded:
                continue
            with contextlib.suppress(ValueError):  # push_all reports it
                deltas = map_deltas(worker.held, plan, pending_after(worker.wanted, plan, worker.pending))
                if deltas is not None:
                    going = outgoing(pid, self.map_path, plan, deltas) if deltas else None
                    found[pid] = Ahead(worker.held, plan, deltas, going)
            await asyncio.sleep(0)  # the operator API and the pushes under way get the loop in between
        return found

    def _worked_out(
        self, worker: WorkerRecord, wanted: Steering, ahead: Ahead | None
    ) -> tuple[list[BackendDelta] | None, Outgoing | None]:
        if ahead is not None and ahead.held is worker.held and ahead.wanted is wanted:
            return ahead.deltas, ahead.going
        deltas = worker.deltas()
        return deltas, outgoing(worker.pid, self.map_path, wanted, deltas) if deltas else None

    def _apply_push(self, worker: WorkerRecord, outcome: PushOutcome) -> None:
        if outcome.read_at is not None:
            worker.verified_at = outcome.read_at
        if outcome.pushed:
            worker.pushes += 1  # a read-back that overlapped the push proves nothing
        if outcome.error is not None:
            worker.held = None  # somewhere in between: read it back before the next try
            self.failed(worker, outcome.error)
            return
        worker.held, worker.pending = outcome.held, set()
        if outcome.pushed:
            worker.verify = True
        worker.failures, worker.retry_at = 0, 0.0
        self.record(worker, "ok")

    def reconcile_due_at(self, workers: Mapping[int, WorkerRecord]) -> float | None:
        return min((w.verified_at + self.RECONCILE_INTERVAL_S for w in workers.values() if _verifiable(w)),
                   default=None)

    async def verify_some(self, workers: Mapping[int, WorkerRecord], poll_s: float, lock: asyncio.Lock) -> bool:
        """Read back the maps just pushed, then those verified longest ago: each at least every
        RECONCILE_INTERVAL_S, a bounded number per poll. True when a map differs: push again now."""
        now = time.monotonic()
        # Read back with the one that is due, the maps whose turn is near: the reconciles then
        # come in batches at rest, not one wake each.
        near = 0.75 * self.RECONCILE_INTERVAL_S
        due = [w for w in workers.values() if _verifiable(w) and (w.verify or now - w.verified_at >= near)]
        due.sort(key=lambda w: (not w.verify, w.verified_at))
        per_poll = max(4, -(-len(workers) * poll_s // self.RECONCILE_INTERVAL_S))

        known = [(w.pid, w.pushes, w.held) for w in due[: int(per_poll)] if w.held is not None]
        maps = await read_back(self.cli, self.map_path, [pid for pid, _, _ in known])
        async with lock:
            drifted = False
            for (pid, pushes, held), got in zip(known, maps, strict=True):
                worker = workers.get(pid)
                if worker is not None:
                    drifted |= self._apply_read_back(worker, pushes, held, got)
            self.publish()
        return drifted

    def _apply_read_back(
        self, worker: WorkerRecord, pushes: int, held: Mapping[str, Entries], got: dict[str, str] | Exception
    ) -> bool:
        """True when `got` differs from what was pushed; `pushes` and `held`: the worker's push
        count and map when the read was decided on."""
        if worker.pushes != pushes or worker.held is not held:
            return False  # pushed again meanwhile: this read proves nothing
        if isinstance(got, Exception):
            worker.unread += 1
            if worker.unread < self.UNREAD_LIMIT:
                log.info("reading old worker %d's map back failed, will retry: %s", worker.pid, got)
                return False
            self.failed(worker, str(got))
        after_push = worker.verify
        worker.unread, worker.verify, worker.verified_at = 0, False, time.monotonic()
        if isinstance(got, Exception):
            return False
        if not after_push:
            # A reconcile also sweeps stuck streams again and, with `observe` (the only thing that
            # marks servers down in an old worker), re-reads its own view: at each reconcile, or,
            # while HAProxy's lines are heard, at the safety net's pace.
            worker.swept = frozenset()
            read_lately = time.monotonic() - worker.unusable_at < self.settings.old_workers.state_read_interval_s
            if self.settings.observe.enabled and not worker.current and not (self.state.server_events and read_lately):
                worker.unusable = None
        difference = map_difference({key: value for part in held.values() for key, value in part}, got)
        if difference:
            worker.held = None
            self.failed(worker, f"worker {worker.pid}: {difference}")
            return True
        return False

    def failed(self, worker: WorkerRecord, error: str) -> None:
        """A push or read-back failed: back off, count it and log it (unless the worker exited)."""
        worker.failures += 1
        worker.retry_at = time.monotonic() + min(self.MAX_BACKOFF_S, 0.1 * 2**worker.failures)
        if GONE not in error:
            self._failures += 1
            log.warning("steering old worker %d failed (attempt %d): %s", worker.pid, worker.failures, error)
        self.record(worker, "failed", error)

    def record(self, worker: WorkerRecord, result: PushStateName, error: str | None = None) -> None:
        steered = worker.wanted.steered if result == "ok" and worker.wanted is not None else ()
        self._news[worker.pid] = PushNews(result, error, steered)

    def publish(self) -> None:
        if self._news or self._failures:
            self.state.publish_pushes(self._news, self._failures)
            self._news, self._failures = {}, 0

    async def sweep(self, workers: Collection[WorkerRecord]) -> None:
        for worker in workers:
            dead = worker.wanted.dead if worker.wanted is not None else frozenset()
            if not dead or worker.swept == dead or worker.current or not worker.in_sync():
                continue
            try:
                ended = await end_stuck_streams(self.cli, worker.pid, dead)
                if ended:
                    log.info("old worker %d: ended %d streams stuck on dead servers", worker.pid, ended)
                worker.swept = dead
            except CLIError as exc:
                log.warning("old worker %d: cannot end stuck streams: %s", worker.pid, exc)


def _verifiable(worker: WorkerRecord) -> bool:
    return worker.wanted is not None and worker.held is not None
