"""The push rounds and their bookkeeping: every map that differs from its plan pushed at
once, maps read back to verify a push and to repair drift, failures backed off, and each old
worker's push record kept for the status API.

A worker whose push failed, or whose map read back differs from what was pushed, is tried
again after an exponential backoff (up to MAX_BACKOFF_S); until then its map counts as
unknown and is read before the next push. A read-back without a whole answer counts as a
failure only UNREAD_LIMIT times in a row: the master drops connections while it re-executes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping

from ..haproxy.api import CLIError, MasterCLI
from ..settings import Settings
from ..state import PushStateName, State
from .push import GONE, PushError, end_stuck_streams, map_difference, push, read_back
from .record import WorkerRecord, record_push

log = logging.getLogger("supervisor.steering")


class PushRounds:
    """Pushes, read-backs and backoff for a set of WorkerRecords (the caller's, by PID)."""

    RECONCILE_INTERVAL_S = 5.0
    MAX_BACKOFF_S = 5.0
    UNREAD_LIMIT = 3  # read-backs in a row without a whole answer before it counts as failed

    def __init__(
        self, settings: Settings, state: State, cli: MasterCLI, reconcile_interval_s: float | None = None
    ) -> None:
        if reconcile_interval_s is not None:
            self.RECONCILE_INTERVAL_S = reconcile_interval_s
        self.settings = settings
        self.state = state
        self.cli = cli
        self.map_path = str(settings.haproxy.steer_map)
        self.last_push: dict[str, float] = {}  # figures of the last push round, for benchmarks

    async def push_all(self, workers: Collection[WorkerRecord]) -> None:
        """Push to every worker whose map differs from its plan (and is not backing off), all at once."""
        started = time.monotonic()
        steered_at: dict[int, float] = {}
        changes = [0]
        due = []
        for worker in workers:
            if worker.wanted is None:
                continue
            if worker.in_sync():
                self.record(worker, "ok")
            elif worker.retry_at <= started:
                self.record(worker, "pending")
                due.append(worker)

        async def one(worker: WorkerRecord) -> None:
            try:
                changes[0] += await push(self.cli, self.map_path, worker, steered_at)
            except (CLIError, PushError, ValueError) as exc:
                worker.held = None  # somewhere in between: read it back before the next try
                self.failed(worker, str(exc))
            else:
                worker.failures, worker.retry_at = 0, 0.0
                self.record(worker, "ok")

        await asyncio.gather(*(one(w) for w in due))
        if steered_at:
            self.state.push_duration.observe(time.monotonic() - started)
            self.last_push = {
                "workers": len(steered_at),
                "changes": changes[0],
                "steered_s": max(steered_at.values()) - started,
                "steered_at": max(steered_at.values()),  # monotonic, when the last one was answered
            }

    async def verify_some(self, workers: Mapping[int, WorkerRecord], poll_s: float, lock: asyncio.Lock) -> bool:
        """Read back the maps just pushed, then those verified longest ago: each map at least
        every RECONCILE_INTERVAL_S, a bounded number per poll. The results are applied under
        `lock` (the rounds'); True when a map differs and a round should push again now."""
        now = time.monotonic()
        due = [
            w
            for w in workers.values()
            if w.wanted is not None
            and w.held is not None
            and (w.verify or now - w.verified_at >= self.RECONCILE_INTERVAL_S)
        ]
        due.sort(key=lambda w: (not w.verify, w.verified_at))
        per_poll = max(4, -(-len(workers) * poll_s // self.RECONCILE_INTERVAL_S))

        known = [(w, w.pushes, w.held) for w in due[: int(per_poll)] if w.held is not None]
        results = await read_back(self.cli, self.map_path, known)
        drifted = False
        async with lock:
            for worker, pushes, held, got in results:
                if workers.get(worker.pid) is not worker or worker.pushes != pushes or worker.held is not held:
                    continue  # pushed again (or gone) meanwhile: this read proves nothing
                if isinstance(got, Exception):
                    worker.unread += 1
                    if worker.unread < self.UNREAD_LIMIT:
                        log.info("reading old worker %d's map back failed, will retry: %s", worker.pid, got)
                        continue
                    self.failed(worker, str(got))
                after_push = worker.verify
                worker.unread, worker.verify, worker.verified_at = 0, False, time.monotonic()
                if isinstance(got, Exception):
                    continue
                if not after_push:
                    # A reconcile also sweeps stuck streams again and, with `observe` (the only
                    # thing that marks servers down in an old worker), re-reads its own view.
                    worker.swept = frozenset()
                    if self.settings.observe.enabled and not worker.current and self._own_view_due(worker):
                        worker.unusable = None
                difference = map_difference({key: value for part in held.values() for key, value in part}, got)
                if difference:
                    worker.held = None
                    self.failed(worker, f"worker {worker.pid}: {difference}")
                    drifted = True
        return drifted

    def _own_view_due(self, worker: WorkerRecord) -> bool:
        """An old worker's own view is read again at each reconcile, or, while HAProxy's lines
        are heard (an `observe` mark-down is one), only at the safety net's pace."""
        safety_net_s = self.settings.old_workers.state_read_interval_s
        return not self.state.server_events or time.monotonic() - worker.unusable_at >= safety_net_s

    def failed(self, worker: WorkerRecord, error: str) -> None:
        """A push or read-back failed: back off, count it and log it (unless the worker exited)."""
        worker.failures += 1
        worker.retry_at = time.monotonic() + min(self.MAX_BACKOFF_S, 0.1 * 2**worker.failures)
        if GONE not in error:
            self.state.push_failures += 1
            log.warning("steering old worker %d failed (attempt %d): %s", worker.pid, worker.failures, error)
        self.record(worker, "failed", error)

    def record(self, worker: WorkerRecord, result: PushStateName, error: str | None = None) -> None:
        record_push(self.state, worker, result, error)

    async def sweep(self, workers: Collection[WorkerRecord]) -> None:
        """End the streams of old workers that still wait on a dead server."""
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
