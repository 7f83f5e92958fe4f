"""What a backend's steer-map entries must be, given its dead servers.

Map layout (one steer map for all backends, read by the guard that haproxy/inject.py puts in
every backend, next to its config's slot table): `<backend>_n` = how many slots the
backend's requests pick from (`0`: answer 503 / close at once), `<backend>_<i>` = the server
for slot i instead of the slot table's. A drain that kills one primary of ten costs two
entries per backend, not ten.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Literal

from ..haproxy.config import Server
from ..haproxy.inject import COUNT_SUFFIX, HOP_SEPARATOR
from .dead import ConfigDigest, SectionDigest, by_backend_of

NoBackup = Literal["fail-fast", "keep"]
FAIL_FAST = "0"  # the value of `<backend>_n` that makes the guard refuse the request
Entries = tuple[tuple[str, str], ...]  # one backend's entries, sorted by key: compared by content


def count_key(backend: str) -> str:
    return f"{backend}_{COUNT_SUFFIX}"


def slot_key(backend: str, index: int) -> str:
    return f"{backend}_{index}"


def is_count_key(key: str) -> bool:
    return key.endswith(f"_{COUNT_SUFFIX}")


def hop_key(backend: str, server: str) -> str:
    return f"{backend}{HOP_SEPARATOR}{server}"


def is_hop_key(key: str) -> bool:
    return HOP_SEPARATOR in key


def backend_of_key(key: str) -> str:
    """The backend a map key belongs to: a hop's is before its `/`; other keys split
    uniquely at their last `_`."""
    backend, hop, _ = key.partition(HOP_SEPARATOR)
    return backend if hop else key.rpartition("_")[0]


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


def steer_entries(
    digest: ConfigDigest, dead: Iterable[str], no_backup: NoBackup, unusable: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The whole steer map a worker running `digest` needs, given its dead servers."""
    entries: dict[str, str] = {}
    for backend, keys in sorted(by_backend_of(dead).items()):
        section = digest.sections.get(backend)
        if section is not None:
            entries.update(section_entries(section, keys, no_backup, unusable))
    return entries


def steered_servers(dead: Iterable[str], entries: Mapping[str, str]) -> list[str]:
    """The dead servers whose backend the entries steer: what an old worker is kept away from."""
    backends = {key.rpartition("_")[0] for key in entries if is_count_key(key)}
    return sorted(key for key in dead if key.partition("/")[0] in backends)
