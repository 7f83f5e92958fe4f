"""Dead servers grouped by backend, worst first, with each backend's size in the running configs."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..haproxy.config import Config
from ..haproxy.resolution import template_names
from ..state import Generation, State


def backend_sizes(model: Config) -> dict[str, int]:
    """Servers per backend (and listen) section, templates expanded, backups included."""
    sizes: dict[str, int] = {}
    for section, server_lines in model.server_flags_by_backend():
        count = 0
        for index, _flags in server_lines:
            words = section.body[index].words
            count += 1 if words[0] == "server" else len(template_names(words[1], words[2]))
        sizes[section.name] = count
    return sizes


class BackendSizes:
    """backend_sizes() of the configs HAProxy runs, merged: a backend's largest size among them.

    Kept per config by its effective sha256 (content, not identity), and only for the configs
    still running: a 10,000-server config is counted once, not on every refresh of the page.
    """

    def __init__(self) -> None:
        self._by_sha: dict[str, dict[str, int]] = {}

    def of(self, generations: Iterable[Generation]) -> dict[str, int]:
        running = {g.effective_sha256: g for g in generations}
        for sha in [sha for sha in self._by_sha if sha not in running]:
            del self._by_sha[sha]
        merged: dict[str, int] = {}
        for sha, generation in running.items():
            sizes = self._by_sha.get(sha)
            if sizes is None:
                sizes = self._by_sha[sha] = backend_sizes(generation.model)
            for backend, size in sizes.items():
                if size > merged.get(backend, 0):
                    merged[backend] = size
        return merged


def running_generations(state: State) -> list[Generation]:
    """The generations the current worker and the old workers run (those that are known)."""
    numbers = {state.current_generation, *(w.generation for w in state.old_workers.values())}
    return [state.generations[n] for n in sorted(n for n in numbers if n is not None) if n in state.generations]


@functools.lru_cache(maxsize=128)
def backends_of(steered: tuple[str, ...]) -> frozenset[str]:
    """The backends of `backend/server` keys. Kept by content: an old worker's 1,000 steered
    servers seldom change between two refreshes of the page, and there are up to 50 of them."""
    return frozenset(key.partition("/")[0] for key in steered)


@dataclass(frozen=True)
class BackendDamage:
    """One backend's dead servers, as the page lists them."""

    backend: str
    dead: tuple[str, ...]  # server names, sorted
    size: int | None  # servers it has in the largest running config that has it; None if unknown
    operator: int  # of the dead, how many an operator marked
    steered_in: int  # old workers steered away from at least one of its servers

    @property
    def share(self) -> float:
        return 1.0 if not self.size else min(1.0, len(self.dead) / self.size)

    @property
    def tone(self) -> str:
        if self.share >= 1.0:
            return "all"
        return "half" if self.share >= 0.5 else "some"

    @property
    def count(self) -> str:
        """`3 of 10 dead`, or `3 dead` when no running config has the backend."""
        return f"{len(self.dead)} of {self.size} dead" if self.size else f"{len(self.dead)} dead"

    @property
    def label(self) -> str:
        return f"{self.backend}: {self.count}"


def damage_by_backend(
    dead_servers: Iterable[str], operator_dead: Iterable[str], old_workers: Iterable[Mapping[str, Any]],
    sizes: Mapping[str, int],
) -> list[BackendDamage]:
    """Dead servers grouped by backend, worst first: the largest share of the backend dead,
    then the most servers dead, then by name."""
    dead: dict[str, list[str]] = {}
    for key in dead_servers:
        backend, _, server = key.partition("/")
        dead.setdefault(backend, []).append(server)
    by_operator: dict[str, int] = {}
    for key in operator_dead:
        backend = key.partition("/")[0]
        by_operator[backend] = by_operator.get(backend, 0) + 1
    steered_in: dict[str, int] = {}
    for worker in old_workers:
        for backend in backends_of(tuple(worker["steered"])):
            steered_in[backend] = steered_in.get(backend, 0) + 1
    damage = [
        BackendDamage(backend, tuple(sorted(servers)), sizes.get(backend), by_operator.get(backend, 0),
                      steered_in.get(backend, 0))
        for backend, servers in dead.items()
    ]
    damage.sort(key=lambda d: (-d.share, -len(d.dead), d.size or 0, natural_key(d.backend)))
    return damage


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """`b9` before `b10`: digit runs compare as numbers."""
    return tuple((1, int(part)) if part.isdigit() else (0, part) for part in _DIGITS.split(name) if part)


_DIGITS = re.compile(r"(\d+)")
