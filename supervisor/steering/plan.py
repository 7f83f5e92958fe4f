"""What every worker's steer map must hold (docs/steering.md#what-an-old-worker-is-told), memoised
by content and worked out from the last plan for the same worker, looking only at what changed."""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..haproxy.guard import HASH_PREFIX, TOTAL_SUFFIX, count_key, slot_key
from ..haproxy.resolution import Server
from ..haproxy.routing import (
    BUCKET_BITS,
    ID_TIMES_4096,
    NodeKeys,
    consistent_buckets,
    effective_weight,
    ring,
    server_ids,
    server_map,
)
from .dead import (
    ConfigDigest,
    DeadGroups,
    LiveView,
    SectionDigest,
    by_backend_of,
    changed_backends,
    dead_group,
    dead_groups,
)

Basis = tuple[str, LiveView]  # (latest config's key, live view): what a plan was made under
NoBackup = Literal["fail-fast", "keep"]
FAIL_FAST = "0"  # the value of `<backend>_n` that makes the guard refuse the request
Entries = tuple[tuple[str, str], ...]  # one backend's entries, sorted by key: compared by content


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
        return {key: value for part in self.parts.values() for key, value in part}


def nothing_steered(digest: ConfigDigest, latest: ConfigDigest, basis: Basis) -> Steering:
    """An empty map: what the current worker holds (unless it is about to become old)."""
    return Steering(basis, ("nothing steered", frozenset()), digest, latest, {}, {})


class Planner:
    """Plans by content: (the worker's config, what it sees down itself) -> its recent plans."""

    RECENT = 3  # plans kept per worker content: a reload's next config and the current one take turns

    def __init__(self, no_backup: NoBackup, node_keys: NodeKeys = ID_TIMES_4096) -> None:
        self.no_backup = no_backup
        self.node_keys = node_keys  # how the workers' binary keys a consistent-hash ring
        self._recent: dict[tuple[str, frozenset[str]], dict[Basis, Steering]] = {}
        self.worked_out = 0  # plans worked out rather than found

    def plan(
        self, latest: ConfigDigest, view: LiveView, workers: Mapping[int, tuple[ConfigDigest, frozenset[str]]]
    ) -> dict[int, Steering]:
        """Each worker's Steering, from (the digest of the config it runs, the servers it skips)."""
        basis: Basis = (latest.key, view)
        plans: dict[int, Steering] = {}
        for pid, (digest, unusable) in workers.items():
            recent = self._recent.setdefault((digest.key, unusable), {})
            found = recent.pop(basis, None)
            if found is None:
                found = self._work_out(digest, unusable, latest, view, next(reversed(recent.values()), None))
                self.worked_out += 1
            recent[basis] = plans[pid] = found  # most recent last
            # Plans under an older view are let go (each can hold thousands of dead servers); a
            # view that comes back is worked out again from the latest plan.
            for old in [b for b in recent if b[1] != view]:
                del recent[old]
            while len(recent) > self.RECENT:
                del recent[next(iter(recent))]
        return plans

    def keep_only(self, digests: Iterable[ConfigDigest]) -> None:
        keys = {d.key for d in digests}
        if any(k[0] not in keys for k in self._recent):
            self._recent = {k: v for k, v in self._recent.items() if k[0] in keys}

    def _work_out(
        self, digest: ConfigDigest, unusable: frozenset[str], latest: ConfigDigest, view: LiveView,
        last: Steering | None,  # this worker content's latest plan, if any: worked out from it
    ) -> Steering:
        skipped = by_backend_of(unusable)

        def entries_of(backend: str, dead: frozenset[str]) -> Entries:
            skips = skipped.get(backend, frozenset())
            return section_entries(digest.sections[backend], dead, self.no_backup, skips, self.node_keys)

        if last is None:
            groups = dead_groups(digest, latest, view)
            parts = {b: e for b, dead in groups.items() if (e := entries_of(b, dead))}
            candidates = set(groups)
        else:
            old_view = last.basis[1]
            candidates = set(changed_backends(last.latest, latest))
            if old_view != view:
                either = old_view.by_backend.keys() | view.by_backend.keys()
                candidates.update(b for b in either if old_view.by_backend.get(b) != view.by_backend.get(b))
            groups = dict(last.groups)
            parts = dict(last.parts)
            for backend in candidates:
                groups.pop(backend, None)
                parts.pop(backend, None)
                if dead := dead_group(digest, latest, view, backend):
                    groups[backend] = dead
                    if entries := entries_of(backend, dead):
                        parts[backend] = entries
        previous = last.basis if last is not None else None
        return Steering(
            (latest.key, view), (digest.key, unusable), digest, latest, groups, parts, previous, frozenset(candidates)
        )


@functools.lru_cache(maxsize=1 << 17)
def section_entries(
    section: SectionDigest,
    dead: frozenset[str],
    no_backup: NoBackup,
    unusable: frozenset[str],
    node_keys: NodeKeys = ID_TIMES_4096,
) -> Entries:
    """One backend's entries; `dead` and `unusable` (what the worker sees DOWN or in MAINT
    itself) may hold other backends' keys. Overrides are chosen by rendezvous hashing, a rank
    no other server's fate changes: a second drain adds entries, changing none already there."""
    if not section.guarded:
        return ()
    backend = section.name

    def usable(s: Server) -> bool:
        return not s.disabled and s.weight != 0 and s.key not in unusable and s.key not in dead

    if not any(s.key in dead and not s.disabled and s.weight != 0 and s.key not in unusable for s in section.slots):
        return ()
    live = [s for s in section.slots if usable(s)]
    primaries = [s.name for s in live]
    if primaries:
        weights = {s.name: effective_weight(s) for s in live}
        overrides = tuple(
            (slot_key(backend, i), min(primaries, key=lambda name, i=i: _weighted_rank(backend, i, name, weights)))
            for i, s in enumerate(section.slots)
            if not usable(s)
        )
        draws = weighted_draws(live, len(section.slots))
        extra = tuple((slot_key(backend, len(section.slots) + j), name) for j, name in enumerate(draws))
        hashed = hash_entries(section, dead, unusable, live, node_keys) if section.hashing else ()
        count = (count_key(backend), str(len(section.slots) + len(draws)))
        return tuple(sorted((*overrides, *extra, *hashed, count)))
    backups = [s.name for s in section.servers if s.backup and usable(s)]
    targets = backups if section.all_backups else backups[:1]
    if not targets:
        return ((count_key(backend), FAIL_FAST),) if no_backup == "fail-fast" else ()
    slots = ((slot_key(backend, i), name) for i, name in enumerate(targets))
    return tuple(sorted((*slots, (count_key(backend), str(len(targets))))))


# The most of a draw's slots that may be overridden: the guard draws three times, so at most
# this cubed of the requests take an override (a fallback spread by weighted rendezvous).
MAX_OVERRIDDEN = 1 / 3


def weighted_draws(live: list[Server], slots: int) -> list[str]:
    """The slots past the table's end (`slots` long) that make a draw pick each live primary
    in proportion to its weight: with weights over their gcd w_i, server i has its own slot and
    k * w_i - 1 more, k the least that leaves at most MAX_OVERRIDDEN of all slots overridden."""
    if len(live) < 2:
        return []
    weights = [effective_weight(s) for s in live]
    divisor = max(math.gcd(*weights), 1)
    units = [w // divisor for w in weights]
    overridden = slots - len(live)
    k = 1
    while overridden > MAX_OVERRIDDEN * (slots + k * sum(units) - len(live)):
        k += 1
    return [s.name for s, u in zip(live, units, strict=True) for _ in range(k * u - 1)]


def hash_entries(
    section: SectionDigest, dead: frozenset[str], unusable: frozenset[str], live: list[Server], node_keys: NodeKeys
) -> Entries:
    """`<be>_t` and the `<be>_h<i>` overrides of a hash the guard reproduces, over the servers
    the worker sees usable. Map-based: each position of a dead server to a live primary by
    weighted rendezvous hashing; consistent: the buckets a dead server's arcs touch."""
    backend = section.name
    seen_up = [s.name for s in section.servers if not s.disabled and s.key not in unusable]
    dead_names = {s.name for s in section.servers if s.key in dead}
    if section.hashing == "consistent":
        ids = server_ids([(s.name, s.params) for s in section.servers])
        buckets = consistent_buckets(ring(section.servers, seen_up, ids, node_keys), dead_names)
        if not buckets:
            return ()
        entries = [(f"{backend}_{HASH_PREFIX}{b}", name) for b, name in buckets.items()]
        return tuple((*entries, (f"{backend}_{TOTAL_SUFFIX}", str(1 << BUCKET_BITS))))
    table = server_map(section.servers, seen_up)
    if not table:
        return ()
    weights = {s.name: effective_weight(s) for s in live}

    def score(position: int, name: str) -> float:
        draw = (_rank(backend, -1 - position, name) + 1) / 2**32
        return -math.log(draw) / weights[name]

    entries = [
        (f"{backend}_{HASH_PREFIX}{i}", min(weights, key=lambda name, i=i: score(i, name)))
        for i, name in enumerate(table)
        if name in dead_names
    ]
    return tuple((*entries, (f"{backend}_{TOTAL_SUFFIX}", str(len(table)))))


def _weighted_rank(backend: str, slot: int, server: str, weights: Mapping[str, int]) -> float:
    """Weighted rendezvous hashing: a server wins a slot with a chance in proportion to its weight."""
    return -math.log(1 - _rank(backend, slot, server) / 2**32) / weights[server]


def _rank(backend: str, slot: int, server: str) -> int:
    """Where `server` ranks for `slot` (lowest first); unlike hash(), the same in every process."""
    return zlib.crc32(f"{backend}_{slot} {server}".encode())
