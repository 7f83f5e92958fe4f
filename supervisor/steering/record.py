"""What the shell keeps per worker (what its map holds and needs, per backend), and the
old workers' records the status API shows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..master.procfs import process_started_at
from ..state import OldWorker, PushState, PushStateName, State, utcnow
from .entries import Entries
from .mapdiff import BackendDelta, backend_delta
from .plan import Steering


@dataclass
class WorkerRecord:
    """One worker: what its map holds and needs, and how its pushes went."""

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
        """Take a new plan; note which backends can now differ from what its map holds."""
        before, self.wanted = self.wanted, steering
        if steering is None or before is None or self.pending is None:
            self.pending = None
        elif steering.source != before.source:
            self.pending = None  # another config, or other servers it skips: compare every backend
        elif steering.previous == before.basis:
            self.pending |= steering.changed
        elif steering.basis != before.basis:
            self.pending = None

    def deltas(self) -> list[BackendDelta] | None:
        """The changes its map needs, per backend (None: its map is unknown)."""
        if self.held is None or self.wanted is None:
            return None
        held, parts = self.held, self.wanted.parts
        backends = self.pending if self.pending is not None else held.keys() | parts.keys()
        deltas = [backend_delta(held.get(b, ()), parts.get(b, ())) for b in backends if held.get(b) != parts.get(b)]
        if not deltas:
            self.held, self.pending = parts, set()
        return deltas

    def in_sync(self) -> bool:
        return self.wanted is not None and self.deltas() == []


def list_old_workers(state: State, old_pids: set[int], generations: Mapping[int, int | None]) -> None:
    """Status bookkeeping: State.old_workers follows `show proc`'s old workers."""
    for pid in [pid for pid in state.old_workers if pid not in old_pids]:
        del state.old_workers[pid]
    for pid in old_pids:
        record = state.old_workers.get(pid)
        if record is None:
            state.old_workers[pid] = OldWorker(pid, generations.get(pid), process_started_at(pid))
        elif record.generation is None:
            record.generation = generations.get(pid)
    state.note_old_workers()


def record_push(state: State, worker: WorkerRecord, result: PushStateName, error: str | None = None) -> None:
    """How a worker's last push went, in its status record (and the servers it is kept from)."""
    record = state.old_workers.get(worker.pid)
    if record is None:
        return  # the worker about to become old: not listed as old yet
    if result == "ok":
        record.steered = worker.wanted.steered if worker.wanted is not None else []
        if record.push.state == "ok":
            return  # keep the time of the push that made it so
    record.push = PushState(result, utcnow() if result != "pending" else record.push.at, error)
