"""Each old worker's hand-off map (haproxy/handoff.py) pushed once and read back; a worker whose
push failed, or whose read-back differs, is tried again at the next round."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ..effective import Effective
from ..haproxy.api import CLIError, MasterCLI
from ..haproxy.config import Config
from ..haproxy.handoff import accepted, handed_off, handoff_entries, map_path, offered
from ..settings import Settings
from ..state import Generation, State
from .mapdiff import Phase, phase_lines
from .push import GONE, PushError, map_difference, read_map, send

log = logging.getLogger("supervisor.steering")


def handoff_changes(held: Mapping[str, str], wanted: Mapping[str, str]) -> Phase:
    """The entries the map `held` lacks of `wanted`, and those it has beyond (a backend the
    current config lost: its requests must stay in the old worker)."""
    adds = tuple((key, value) for key, value in wanted.items() if key not in held)
    dels = tuple(key for key in held if key not in wanted)
    return Phase(adds=adds, dels=dels)


@dataclass
class _Worker:
    wanted: dict[str, str]
    confirmed: bool = False
    error: str | None = None


class HandOffs:
    def __init__(self, settings: Settings, state: State, cli: MasterCLI) -> None:
        self.state = state
        self.cli = cli
        self.map_path = str(map_path(settings.haproxy.runtime_dir))
        self._workers: dict[int, _Worker] = {}
        # By effective sha256: each config is looked at once, whatever the workers running it.
        self._offers: dict[str, dict[str, str]] = {}
        self._accepts: dict[str, dict[str, str]] = {}
        self._wanted: dict[tuple[str, str], dict[str, str]] = {}  # by (old, current)

    def _handed_off(self, old: Generation, target: Config, target_sha256: str) -> dict[str, str]:
        key = (old.effective_sha256, target_sha256)
        entries = self._wanted.get(key)
        if entries is None:
            offers = self._offers.get(old.effective_sha256)
            if offers is None:
                offers = self._offers[old.effective_sha256] = offered(old.model)
            accepts = self._accepts.get(target_sha256)
            if accepts is None:
                accepts = self._accepts[target_sha256] = accepted(target)
            entries = self._wanted[key] = handoff_entries(handed_off(offers, accepts))
        return entries

    async def round(
        self, old: Mapping[int, Generation], current: Generation | None, upcoming: Effective | None = None
    ) -> None:
        """Push to every old worker (its config known) whose map is not confirmed to be what it
        needs. `upcoming`: the config a reload is about to send; until it is current, a backend
        it lacks is handed off no more (make-before-break)."""
        self._workers = {pid: worker for pid, worker in self._workers.items() if pid in old}
        targets = {g.effective_sha256 for g in (current,) if g is not None}
        targets |= {upcoming.sha256} if upcoming is not None else set()
        self._wanted = {key: entries for key, entries in self._wanted.items() if key[1] in targets}
        self._accepts = {key: accepts for key, accepts in self._accepts.items() if key in targets}
        running = {g.effective_sha256 for g in old.values()}
        self._offers = {key: offers for key, offers in self._offers.items() if key in running}
        if current is None:
            return
        due: dict[int, _Worker] = {}
        for pid, generation in old.items():
            wanted = self._handed_off(generation, current.model, current.effective_sha256)
            if upcoming is not None:
                next_wanted = self._handed_off(generation, upcoming.effective_model, upcoming.sha256)
                wanted = {key: value for key, value in wanted.items() if key in next_wanted}
            worker = self._workers.get(pid)
            if worker is None or worker.wanted != wanted:
                worker = self._workers[pid] = _Worker(wanted)
            if not worker.confirmed:
                due[pid] = worker
        await asyncio.gather(*(self._push(pid, worker) for pid, worker in due.items()))
        self.state.publish_handed_off({pid: len(w.wanted) if w.confirmed else 0 for pid, w in self._workers.items()})

    async def _push(self, pid: int, worker: _Worker) -> None:
        try:
            held = await read_map(self.cli, self.map_path, pid)
            changes = handoff_changes(held, worker.wanted)
            if changes:
                await send(self.cli, pid, phase_lines(pid, self.map_path, changes))
                held = await read_map(self.cli, self.map_path, pid)
            difference = map_difference(worker.wanted, held)
            if difference is not None:
                raise PushError(f"worker {pid}: hand-off {difference}")
        except (CLIError, PushError, ValueError) as exc:
            if str(exc) != worker.error:
                # A worker that just exited is no failure: the next round lists it no more.
                level = logging.DEBUG if GONE in str(exc) else logging.WARNING
                log.log(level, "hand-off: worker %d: %s (tried again at the next round)", pid, exc)
            worker.error = str(exc)
            return
        worker.confirmed, worker.error = True, None
        if worker.wanted:
            log.info("hand-off: worker %d hands %d backends to the current worker", pid, len(worker.wanted))
