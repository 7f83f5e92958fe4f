"""One round's plan: what every worker's steer map must hold, memoised by content.

A worker's wanted map depends on four things only: the config it runs, the latest config,
the live view (the current worker's and the operator's evidence) and the servers the worker
itself sees down. Every one has a content key, so a plan is looked up by those keys, and a
new one is worked out from the last one for the same worker content, backend by backend,
where something can have changed: the backends whose section differs between the two
latest configs, and those whose evidence changed. A drain touches a hundred backends of a
thousand in each of fifty generations; an idle round touches none.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..haproxy.routing import ID_TIMES_4096, NodeKeys
from .dead import ConfigDigest, DeadGroups, LiveView, by_backend_of, changed_backends, dead_group, dead_groups
from .entries import Entries, NoBackup, section_entries

_changed_backends = functools.lru_cache(maxsize=16)(changed_backends)

Basis = tuple[str, LiveView]  # (latest config's key, live view): what a plan was made under


@dataclass(frozen=True)
class Steering:
    """What one worker needs under one basis: its dead servers and its entries, per backend."""

    basis: Basis
    source: tuple[str, frozenset[str]] = field(compare=False)  # the worker's config key, the servers it skips
    digest: ConfigDigest = field(compare=False)  # the config the worker runs
    latest: ConfigDigest = field(compare=False)
    groups: DeadGroups = field(compare=False)  # backend -> dead servers (backends without any left out)
    parts: Mapping[str, Entries] = field(compare=False)  # backend -> entries (backends without any left out)
    previous: Basis | None = field(compare=False, default=None)  # the plan this one was worked out from
    changed: frozenset[str] = field(compare=False, default=frozenset())  # backends that can differ from it

    @functools.cached_property
    def dead(self) -> frozenset[str]:
        return frozenset().union(*self.groups.values())

    @functools.cached_property
    def steered(self) -> list[str]:
        """The dead servers whose backend has entries: what the worker is kept away from."""
        return sorted(key for backend, keys in self.groups.items() if backend in self.parts for key in keys)

    def entries(self) -> dict[str, str]:
        """The whole map."""
        return {key: value for part in self.parts.values() for key, value in part}


def reused_plans(
    last: Mapping[int, Steering], workers: Mapping[int, tuple[ConfigDigest, frozenset[str]]]
) -> dict[int, Steering]:
    """The plans of a round made under the same basis that still hold: for a worker that
    runs the same config and skips the same servers (the rest must be planned)."""
    return {
        pid: steering
        for pid, (digest, unusable) in workers.items()
        if (steering := last.get(pid)) is not None and steering.source == (digest.key, unusable)
    }


def nothing_steered(digest: ConfigDigest, latest: ConfigDigest, basis: Basis) -> Steering:
    """An empty map: what the current worker holds (unless it is about to become old)."""
    return Steering(basis, ("nothing steered", frozenset()), digest, latest, {}, {})


@functools.lru_cache(maxsize=1 << 17)
def _entries(section_entries_args: tuple) -> Entries:
    return section_entries(*section_entries_args)


class Planner:
    """Plans by content: (the worker's config, what it sees down itself) -> its recent plans."""

    RECENT = 3  # plans kept per worker content: a reload's next config and the current one take turns

    def __init__(self, no_backup: NoBackup, node_keys: NodeKeys = ID_TIMES_4096) -> None:
        self.no_backup = no_backup
        self.node_keys = node_keys  # how the workers' binary keys a consistent-hash ring
        self._recent: dict[tuple[str, frozenset[str]], dict[Basis, Steering]] = {}

    def plan(
        self, latest: ConfigDigest, view: LiveView, workers: Mapping[int, tuple[ConfigDigest, frozenset[str]]]
    ) -> dict[int, Steering]:
        """Each worker's Steering, from (the digest of the config it runs, the servers it skips)."""
        basis: Basis = (latest.key, view)
        return {pid: self._one(digest, unusable, latest, view, basis) for pid, (digest, unusable) in workers.items()}

    def keep_only(self, digests: Iterable[ConfigDigest]) -> None:
        """Forget the plans of configs no worker runs any more."""
        keys = {d.key for d in digests}
        if any(k[0] not in keys for k in self._recent):
            self._recent = {k: v for k, v in self._recent.items() if k[0] in keys}

    def _one(
        self, digest: ConfigDigest, unusable: frozenset[str], latest: ConfigDigest, view: LiveView, basis: Basis
    ) -> Steering:
        recent = self._recent.setdefault((digest.key, unusable), {})
        found = recent.pop(basis, None)
        if found is None:
            found = self._work_out(digest, unusable, latest, view, basis, next(reversed(recent.values()), None))
        recent[basis] = found  # most recent last
        while len(recent) > self.RECENT:
            del recent[next(iter(recent))]
        return found

    def _work_out(
        self,
        digest: ConfigDigest,
        unusable: frozenset[str],
        latest: ConfigDigest,
        view: LiveView,
        basis: Basis,
        last: Steering | None,
    ) -> Steering:
        skipped = by_backend_of(unusable)
        nothing: frozenset[str] = frozenset()

        def entries_of(backend: str, dead: frozenset[str]) -> Entries:
            args = (digest.sections[backend], dead, self.no_backup, skipped.get(backend, nothing), self.node_keys)
            return _entries(args)

        if last is None:
            groups = dead_groups(digest, latest, view)
            parts = {b: e for b, dead in groups.items() if (e := entries_of(b, dead))}
            return Steering(basis, (digest.key, unusable), digest, latest, groups, parts, None, frozenset(groups))
        old_view = last.basis[1]
        candidates = set(_changed_backends(last.latest, latest))
        if old_view != view:
            candidates.update(
                b
                for b in old_view.by_backend.keys() | view.by_backend.keys()
                if old_view.by_backend.get(b) != view.by_backend.get(b)
            )
        groups = dict(last.groups)
        parts = dict(last.parts)
        for backend in candidates:
            dead = dead_group(digest, latest, view, backend)
            entries = entries_of(backend, dead) if dead else ()
            if dead:
                groups[backend] = dead
            else:
                groups.pop(backend, None)
            if entries:
                parts[backend] = entries
            else:
                parts.pop(backend, None)
        return Steering(
            basis, (digest.key, unusable), digest, latest, groups, parts, last.basis, frozenset(candidates)
        )
