"""What a backend's steer-map entries must be, given its dead servers.

Map layout (one steer map for all backends, read by the guard that haproxy/guard.py puts in
every backend, next to its config's slot table): `<backend>_n` = how many slots the
backend's requests pick from (`0`: answer 503 / close at once), `<backend>_<i>` = the server
for slot i instead of the slot table's. A drain that kills one primary of ten costs two
entries per backend, not ten.
"""

from __future__ import annotations

import zlib
from typing import Literal

from ..haproxy.guard import count_key, slot_key
from ..haproxy.resolution import Server
from .dead import SectionDigest

NoBackup = Literal["fail-fast", "keep"]
FAIL_FAST = "0"  # the value of `<backend>_n` that makes the guard refuse the request
Entries = tuple[tuple[str, str], ...]  # one backend's entries, sorted by key: compared by content


def section_entries(
    section: SectionDigest, dead: frozenset[str], no_backup: NoBackup, unusable: frozenset[str]
) -> Entries:
    """One backend's entries. `dead` and `unusable` may hold other backends' keys too.

    Only a backend with the guard and a dead primary it could still route to gets entries.
    While some primary is usable, the count is the number of slots, and each slot whose
    server is not usable is overridden with a usable primary chosen by rendezvous hashing:
    the one that ranks first for that slot, a rank no other server's fate changes. So a
    drain costs one entry per dead primary, and a second drain adds entries without
    changing those there, unless it kills an override's target. With no usable primary the
    requests go to the first usable backup (every one, with `option allbackups`), each
    overriding one slot; with no backup either, `fail-fast` makes the guard answer at once
    and `keep` leaves routing alone. `unusable`: servers the worker itself sees DOWN or in
    maintenance, which a `use-server` rule would skip: no use as targets, nothing to steer from.
    """
    if not section.guarded:
        return ()
    backend = section.name

    def usable(s: Server) -> bool:
        return not s.disabled and s.weight != 0 and s.key not in unusable and s.key not in dead

    if not any(s.key in dead and not s.disabled and s.weight != 0 and s.key not in unusable for s in section.slots):
        return ()
    primaries = [s.name for s in section.slots if usable(s)]
    if primaries:
        overrides = tuple(
            (slot_key(backend, i), min(primaries, key=lambda name, i=i: _rank(backend, i, name)))
            for i, s in enumerate(section.slots)
            if not usable(s)
        )
        return tuple(sorted((*overrides, (count_key(backend), str(len(section.slots))))))
    backups = [s.name for s in section.servers if s.backup and usable(s)]
    targets = backups if section.all_backups else backups[:1]
    if not targets:
        return ((count_key(backend), FAIL_FAST),) if no_backup == "fail-fast" else ()
    slots = ((slot_key(backend, i), name) for i, name in enumerate(targets))
    return tuple(sorted((*slots, (count_key(backend), str(len(targets))))))


def _rank(backend: str, slot: int, server: str) -> int:
    """Where `server` ranks for taking over `slot` (lowest first). The same in every process
    and after a restart, unlike hash(); spread like a random draw."""
    return zlib.crc32(f"{backend}_{slot} {server}".encode())
