"""What the shell keeps per worker: what its map holds and what it needs, per backend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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
        elif steering.previous == before.basis and steering.digest == before.digest:
            self.pending |= steering.changed
        elif not (steering.basis == before.basis and steering.digest == before.digest):
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
