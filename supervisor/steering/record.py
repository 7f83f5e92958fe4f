"""What the shell keeps per worker: what its map holds and needs, per backend, and how its
pushes went. Only PushRounds (rounds.py) changes a record; the functions here are pure."""

from __future__ import annotations

from collections.abc import Collection, Mapping
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
        self.pending = pending_after(self.wanted, steering, self.pending)
        self.wanted = steering

    def deltas(self) -> list[BackendDelta] | None:
        """The changes its map needs, per backend (None: its map is unknown)."""
        return map_deltas(self.held, self.wanted, self.pending)

    def deltas_to(self, steering: Steering) -> list[BackendDelta] | None:
        """The changes its map would need once it takes `steering` (None: its map is unknown)."""
        return map_deltas(self.held, steering, pending_after(self.wanted, steering, self.pending))

    def in_sync(self) -> bool:
        return self.wanted is not None and self.deltas() == []


def pending_after(before: Steering | None, after: Steering | None, pending: set[str] | None) -> set[str] | None:
    """The backends where a worker's map may differ from its plan once it takes `after`
    instead of `before` (None: any)."""
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
    """The changes a map holding `held` needs to be `wanted`, per backend, looking only at
    `pending` (None: at every backend). None: the map is unknown, or nothing is wanted."""
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
