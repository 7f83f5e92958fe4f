"""Every config in use, digested once: what each generation runs (by its number and its
effective config's sha256), the config prepare() planned for, and an index of their servers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable

from ..effective import Effective
from ..eventloop import sliced
from ..state import Generation
from .dead import ConfigDigest, Sections


class ServerIndex:
    """Which "backend/server" some config in use has, in one lookup. Counted per section in
    use: a config added costs only its sections no other config holds."""

    def __init__(self) -> None:
        self._sections: Counter[str] = Counter()
        self._servers: Counter[str] = Counter()

    def add(self, digest: ConfigDigest) -> None:
        for section in digest.section_set:
            self._sections[section.key] += 1
            if self._sections[section.key] == 1:
                self._servers.update(s.key for s in section.servers)

    def remove(self, digest: ConfigDigest) -> None:
        for section in digest.section_set:
            self._sections[section.key] -= 1
            if self._sections[section.key] == 0:
                del self._sections[section.key]
                self._servers.subtract(s.key for s in section.servers)
                for s in section.servers:
                    if self._servers[s.key] <= 0:
                        del self._servers[s.key]

    def __contains__(self, key: str) -> bool:
        return key in self._servers


class Digests:
    def __init__(self) -> None:
        self.sections = Sections()
        self.servers = ServerIndex()  # the servers of every generation's config
        self.prepared: ConfigDigest | None = None  # the config prepare() planned for, until after_reload
        self._of_generation: dict[tuple[int, str], ConfigDigest] = {}

    async def of_effective(self, effective: Effective) -> ConfigDigest:
        """The next config's digest, the event loop let run between its slices."""
        return await sliced(self.sections.digesting(effective.effective_model, effective.sha256))

    def of(self, generation: Generation) -> ConfigDigest:
        key = (generation.number, generation.effective_sha256)
        digest = self._of_generation.get(key)
        if digest is None:
            digest = self._of_generation[key] = self.sections.digest(generation.model, generation.effective_sha256)
            self.servers.add(digest)
        return digest

    def has_server(self, key: str, generations: Collection[Generation]) -> bool:
        """Whether some generation's config has this "backend/server": one index lookup (every
        round digests each generation; one not seen yet is digested first)."""
        if len(generations) != len(self._of_generation):
            for generation in generations:
                self.of(generation)
        return key in self.servers

    def keep_only(self, generations: Iterable[Generation], latest: ConfigDigest) -> list[ConfigDigest]:
        """Forget every config but these (and the prepared one); the digests kept. The sections
        no config holds any more are let go only when a generation went."""
        keep = {(g.number, g.effective_sha256) for g in generations}
        gone = [k for k in self._of_generation if k not in keep]
        for key in gone:
            self.servers.remove(self._of_generation.pop(key))
        kept = [latest, *self._of_generation.values(), *([self.prepared] if self.prepared is not None else [])]
        if gone:
            self.sections.keep_only(kept)
        return kept
