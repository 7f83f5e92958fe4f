"""Which servers are dead, per generation, by the three rules of docs/steering.md#known-dead-servers.
Section digests are interned by content: fifty generations share one copy of each section."""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field

from ..effective import Effective
from ..eventloop import finished, sliced
from ..haproxy.api import DEFAULT_LINE_LIMIT
from ..haproxy.config import Config, Section
from ..haproxy.guard import SLOT_TABLE_PREFIX, is_guarded
from ..haproxy.lexer import content_key
from ..haproxy.resolution import Server, is_ip, section_servers
from ..haproxy.routing import routing_of
from ..state import Generation, SuspectServer
from .live import At, LiveStates

DeadGroups = Mapping[str, frozenset[str]]  # backend -> its dead servers' "backend/server" keys


def at(backend: str, address: str) -> At:
    return f"{backend} {address}"


@dataclass(frozen=True)
class SectionDigest:
    """One backend or listen section's servers, as the decisions need them; equal by `key`."""

    key: bytes  # content_key() of the section's text and what applies to it, minus the slot table's name
    name: str = field(compare=False)
    servers: tuple[Server, ...] = field(compare=False)
    by_name: dict[str, Server] = field(compare=False)
    at_keys: dict[At, tuple[str, ...]] = field(compare=False)  # enabled servers per (backend, endpoint)
    present: frozenset[At] = field(compare=False)  # the same, as a set: where this section routes to
    named_hosts: tuple[Server, ...] = field(compare=False)  # given by host name: the live address differs
    slots: tuple[Server, ...] = field(compare=False)  # the primaries; slot i is slots[i] (guard.slot_table)
    guarded: bool = field(compare=False)
    all_backups: bool = field(compare=False)  # `option allbackups`
    changes_alone: bool = field(compare=False)  # some server is checked or observed: its state can change
    hashing: str = field(compare=False)  # "", "map-based" or "consistent": its guard reproduces a hash

    @classmethod
    def of(cls, key: bytes, servers: list[Server], section: Section, all_backups: bool, hashing: str) -> SectionDigest:
        at_keys: dict[At, list[str]] = {}
        for s in servers:
            if not s.disabled:
                at_keys.setdefault(at(s.backend, s.endpoint), []).append(s.key)
        return cls(
            key=key,
            name=section.name,
            servers=tuple(servers),
            by_name={s.name: s for s in servers},
            at_keys={where: tuple(keys) for where, keys in at_keys.items()},
            present=frozenset(at_keys),
            named_hosts=tuple(s for s in servers if s.port is not None and not is_ip(s.address)),
            slots=tuple(s for s in servers if not s.backup),
            guarded=is_guarded(section),
            all_backups=all_backups,
            changes_alone=any(s.check or s.observe or "agent-check" in s.params for s in servers),
            hashing=hashing,
        )


@dataclass(frozen=True)
class ConfigDigest:
    """What the decisions need from one config: its sections by name, and a key of its content."""

    key: str  # a hash of its sections' keys, in order
    sections: dict[str, SectionDigest] = field(compare=False)
    section_set: frozenset[SectionDigest] = field(compare=False)
    named_hosts: tuple[Server, ...] = field(compare=False)
    guarded: bool = field(compare=False)  # some section has the guard: the worker can be steered
    changes_alone: bool = field(compare=False)  # some server's state can change by itself (checks)
    quiet: bool = field(compare=False)  # `quiet` in global: HAProxy writes no message to stderr
    limit: int = field(compare=False)  # the longest CLI line its processes accept

    def server(self, key: str) -> Server | None:
        backend, _, name = key.partition("/")
        section = self.sections.get(backend)
        return section.by_name.get(name) if section is not None else None


_SLOT_TABLE_NAME = re.compile(re.escape(SLOT_TABLE_PREFIX) + r"[0-9a-f]+\.map")


class Sections:
    """Section digests interned by content (its text, and what applies to it from its defaults)."""

    RECENT_CONFIGS = 3  # whole configs remembered by their sha256: the next one, the current one

    def __init__(self) -> None:
        self._by_key: dict[bytes, SectionDigest] = {}
        self._by_sha256: dict[str, ConfigDigest] = {}

    def digest(self, model: Config, sha256: str | None = None) -> ConfigDigest:
        """`sha256` (of its effective text) finds one seen lately."""
        return finished(self.digesting(model, sha256))

    def digesting(self, model: Config, sha256: str | None = None) -> Generator[None, None, ConfigDigest]:
        found = self._by_sha256.pop(sha256, None) if sha256 is not None else None
        if found is None:
            found = yield from self._digest(model)
        if sha256 is not None:
            self._by_sha256[sha256] = found  # most recent last
            while len(self._by_sha256) > self.RECENT_CONFIGS:
                del self._by_sha256[next(iter(self._by_sha256))]
        return found

    # Between two turns of the event loop: SLICE sections found, or NEW_SLICE digested anew
    # (their servers made, far more work: a drain brings many at once).
    SLICE = 200
    NEW_SLICE = 20

    def _digest(self, model: Config) -> Generator[None, None, ConfigDigest]:
        sections: dict[str, SectionDigest] = {}
        applied: dict[object, str] = {}  # one ProxySettings serves hundreds of backends: one repr
        looked = made = 0
        for section, settings in model.each_backend_with_settings():
            inherited = applied.get(settings)
            if inherited is None:
                inherited = applied[settings] = repr(settings) + "\n"
            header = section.header.raw if section.header is not None else ""
            text = header + "".join([line.raw for line in section.body])
            # Every reload that moves a replica names a new slot table in every guarded
            # section; the digest does not depend on the name, and must stay shared.
            key = content_key(inherited + (_SLOT_TABLE_NAME.sub("", text) if SLOT_TABLE_PREFIX in text else text))
            digest = self._by_key.get(key)
            if digest is None:
                servers = section_servers(section, settings, model.cache)
                routing = routing_of(settings, section.body, section.name)
                hashing = ("consistent" if routing.consistent else "map-based") if routing.hashed else ""
                digest = self._by_key[key] = SectionDigest.of(key, servers, section, settings.all_backups, hashing)
                made += 1
            sections[section.name] = digest
            looked += 1
            if looked >= self.SLICE or made >= self.NEW_SLICE:
                looked = made = 0
                yield
        fingerprint = hashlib.blake2b(b"".join(sd.key for sd in sections.values()), digest_size=16)
        return ConfigDigest(
            key=fingerprint.hexdigest(),
            sections=sections,
            section_set=frozenset(sections.values()),
            named_hosts=tuple(s for sd in sections.values() for s in sd.named_hosts),
            guarded=any(sd.guarded for sd in sections.values()),
            changes_alone=any(sd.changes_alone for sd in sections.values()),
            quiet=model.global_setting("quiet") is not None,
            limit=line_limit(model),
        )

    def keep_only(self, digests: Iterable[ConfigDigest]) -> None:
        kept = list(digests)
        used = {sd.key for d in kept for sd in d.section_set}
        self._by_key = {k: v for k, v in self._by_key.items() if k in used}
        keys = {d.key for d in kept}
        self._by_sha256 = {t: d for t, d in self._by_sha256.items() if d.key in keys}


def line_limit(model: Config) -> int:
    """The longest CLI line the processes accept: tune.bufsize (16384 unless set) minus room."""
    line = model.global_setting("tune.bufsize")
    if line is not None and len(line.words) > 1 and line.words[1].isdigit():
        return min(DEFAULT_LINE_LIMIT, int(line.words[1]) - 384)
    return DEFAULT_LINE_LIMIT


@dataclass(frozen=True)
class LiveView:
    """What the latest config, the current worker and the operator say, per (backend, endpoint)."""

    down: frozenset[At] = frozenset()  # where the current worker has servers and none is alive
    operator: frozenset[str] = frozenset()  # "backend/server" marked dead by an operator
    operator_at: frozenset[At] = frozenset()  # where those servers live in the latest config

    @functools.cached_property
    def by_backend(self) -> dict[str, tuple[frozenset[At], frozenset[str]]]:
        """Per backend: its endpoints in `down` or `operator_at`, its keys in `operator`."""
        wheres: dict[str, set[At]] = {}
        for where in self.down | self.operator_at:
            wheres.setdefault(where.partition(" ")[0], set()).add(where)
        keys = by_backend_of(self.operator)
        return {b: (frozenset(wheres.get(b, ())), keys.get(b, frozenset())) for b in wheres.keys() | keys.keys()}


def live_view(
    latest: ConfigDigest, live: LiveStates, operator_dead: Iterable[str], previous_down: frozenset[At] = frozenset(),
    suspects: Iterable[SuspectServer] = (),
) -> LiveView:
    """Combine the evidence. `previous_down`: the last view's `down`, kept while the current
    worker has no verdict yet (right after a reload). `suspects`: the detector's, but for those
    the current worker keeps (left in): an old worker steered off them would answer 503 where
    the current one still routes."""
    operator = frozenset(operator_dead)
    down = set(live.down) | (previous_down & live.pending)
    down.update(at(s.key.partition("/")[0], s.endpoint) for s in suspects if not s.left_in)
    # The live state shows the resolved address: carry the verdict over by name. Only for
    # host names: during a make-before-break the live states come from the worker that
    # runs the older config, where the same name may sit at another address.
    alive: set[At] = set()
    for s in latest.named_hosts:
        verdict = live.alive_by_key.get(s.key)
        where = at(s.backend, s.endpoint)
        if verdict is False or (verdict is None and where in previous_down):
            down.add(where)
        elif verdict:
            alive.add(where)
    down -= alive
    operator_at = frozenset(at(s.backend, s.endpoint) for k in operator if (s := latest.server(k)) is not None)
    return LiveView(frozenset(down), operator, operator_at)


@functools.lru_cache(maxsize=16)
def changed_backends(old_latest: ConfigDigest, new_latest: ConfigDigest) -> frozenset[str]:
    """The backends whose section differs between two configs, or is in one only."""
    return frozenset(s.name for s in old_latest.section_set ^ new_latest.section_set)


def dead_group(digest: ConfigDigest, latest: ConfigDigest, view: LiveView, backend: str) -> frozenset[str]:
    """The dead servers of one backend of `digest`, by the three rules."""
    section = digest.sections.get(backend)
    if section is None:
        return frozenset()
    keys: set[str] = set()
    latest_section = latest.sections.get(backend)
    if section != latest_section:  # rule (a): only a section that differs can drop servers
        present = latest_section.present if latest_section is not None else frozenset()
        keys.update(key for where, at_keys in section.at_keys.items() if where not in present for key in at_keys)
    if backend in view.by_backend:  # rules (b) and (c)
        wheres, marked = view.by_backend[backend]
        keys.update(key for where in wheres for key in section.at_keys.get(where, ()))
        keys.update(k for k in marked if (s := section.by_name.get(k.partition("/")[2])) is not None and not s.disabled)
    return frozenset(keys)


def dead_groups(digest: ConfigDigest, latest: ConfigDigest, view: LiveView) -> dict[str, frozenset[str]]:
    """Every backend's dead servers, backends without any left out."""
    candidates = {s.name for s in digest.section_set - latest.section_set} | view.by_backend.keys()
    return {name: dead for name in candidates if (dead := dead_group(digest, latest, view, name))}


def by_backend_of(keys: Iterable[str]) -> dict[str, frozenset[str]]:
    """"backend/server" keys grouped by backend."""
    groups: dict[str, set[str]] = {}
    for key in keys:
        groups.setdefault(key.partition("/")[0], set()).add(key)
    return {backend: frozenset(members) for backend, members in groups.items()}


class Digests:
    def __init__(self) -> None:
        self.sections = Sections()
        self._of_generation: dict[tuple[int, str], ConfigDigest] = {}

    async def of_effective(self, effective: Effective) -> ConfigDigest:
        return await sliced(self.sections.digesting(effective.effective_model, effective.sha256))

    def of(self, generation: Generation) -> ConfigDigest:
        key = (generation.number, generation.effective_sha256)
        digest = self._of_generation.get(key)
        if digest is None:
            digest = self._of_generation[key] = self.sections.digest(generation.model, generation.effective_sha256)
        return digest

    def has_server(self, key: str, generations: Iterable[Generation]) -> bool:
        return any(self.of(generation).server(key) is not None for generation in generations)

    def keep_only(self, generations: Iterable[Generation], latest: ConfigDigest) -> list[ConfigDigest]:
        """Forget every config but these and `latest`; the digests kept."""
        keep = {(g.number, g.effective_sha256) for g in generations}
        gone = self._of_generation.keys() - keep
        for key in gone:
            del self._of_generation[key]
        kept = [latest, *self._of_generation.values()]
        if gone:
            self.sections.keep_only(kept)
        return kept
