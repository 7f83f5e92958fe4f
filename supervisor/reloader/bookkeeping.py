"""The generations the daemon knows, and the files that record them and what runs: the
effective config on disk, generations/*.cfg, generations.json; old workers beyond the limit."""

from __future__ import annotations

import logging
import os
import signal

import psutil

from ..effective import Effective, remove_stale_slot_tables, sha256_text, write_atomically, write_slot_table
from ..generations import Snapshot, prunable, record_of
from ..haproxy.api import Proc, ProcList
from ..haproxy.config import Config
from ..state import Generation, utcnow
from .base import LoadedConfig, ReloaderBase
from .problems import io_error_line

log = logging.getLogger(__package__)


def old_workers_over_max(procs: ProcList, max_old: int) -> list[Proc]:
    """The old workers beyond `max_old`, oldest first (the most reloads ago, then lowest PID)."""
    olds = sorted(procs.old_workers, key=lambda p: (-p.reloads, p.pid))
    excess = len(olds) - max_old
    return olds[:excess] if excess > 0 else []


class Bookkeeping(ReloaderBase):
    def _write_back(self) -> None:
        """The effective config on disk is what a restarted master loads: keep it what runs."""
        loaded = self.loaded
        if loaded is None or loaded.sha256 == self._on_disk_sha:
            return
        try:
            write_slot_table(loaded.slot_table)
            self._write_effective_text(loaded.text)
        except OSError as exc:
            error = io_error_line(exc)
            self.problems.happened("effective config", error, f"cannot write back the running config: {error}")
            return
        self.problems.over("effective config")

    def _write_effective_text(self, text: str) -> None:
        write_atomically(self.settings.haproxy.effective_config, text)
        self._on_disk_sha = sha256_text(text)

    def _loaded_by(self, effective: Effective, inputs: str, after: ProcList) -> Generation:
        """HAProxy's current worker (from `show proc`) runs `effective`: record it as a generation.
        What HAProxy runs is decided; the writes that follow are bookkeeping, and their failure
        (a full disk) changes nothing of it."""
        worker = after.current_worker
        assert worker is not None
        generation = self._new_generation(
            effective.effective_model, effective.sha256, effective.rendered_sha256, inputs, worker.pid
        )
        self.loaded = LoadedConfig.of(effective, inputs)
        self._pending = None
        self._write_generation_config(generation.number, effective.text)
        self._remove_stale_slot_tables(effective)
        self._observe(after)
        return generation

    def _write_generation_config(self, number: int, text: str) -> None:
        try:
            self.store.write_config(number, text)
        except OSError as exc:
            error = io_error_line(exc)
            self.problems.happened("generation configs", error, (
                f"cannot record generation {number}'s config: {error} "
                "(HAProxy runs it; a daemon restarted now would not know its text)"
            ))
            return
        self.problems.over("generation configs")

    def _remove_stale_slot_tables(self, running: Effective) -> None:
        try:
            removed = remove_stale_slot_tables(self.settings.haproxy.runtime_dir, running.slot_table)
        except OSError as exc:  # a leftover file costs disk space, not the reload
            log.warning("cannot remove old slot tables: %s", exc.strerror or exc)
            return
        if removed:
            log.debug("slot tables removed: %s", ", ".join(p.name for p in removed))

    def _restore_loaded(self) -> bool:
        """Put the config that runs back on disk, for a master restart to load (after a reload
        HAProxy refused: nothing is pending any more)."""
        if self._pending is not None:
            self._pending = None
            self._persist()
        self._on_disk_sha = None
        self._write_back()
        return self.loaded is None or self._on_disk_sha == self.loaded.sha256

    def _new_generation(
        self, model: Config, effective_sha: str, rendered_sha: str, inputs: str | None, worker_pid: int
    ) -> Generation:
        self._last_number += 1
        generation = Generation(self._last_number, model, effective_sha, rendered_sha, utcnow(), worker_pid)
        self.state.generations[generation.number] = generation
        self.state.current_generation = generation.number
        self.state.last_good_sha256 = effective_sha
        self._inputs[generation.number] = inputs
        return generation

    def _persist(self) -> None:
        records = tuple(record_of(g, self._inputs.get(n)) for n, g in self.state.generations.items())
        snapshot = Snapshot(records, self.state.current_generation, self._last_number, self._pending)
        if snapshot == self._persisted:
            return
        try:
            self.store.save(snapshot)
            self._persisted = snapshot
        except OSError as exc:
            error = io_error_line(exc)
            self.problems.happened("generations index", error, f"cannot record the generations: {error}")
            return
        self.problems.over("generations index")

    def _observe(self, procs: ProcList) -> None:
        """Prune dead generations and enforce old_workers.max from one `show proc` answer."""
        self.last_procs = procs
        gone = prunable(self.state.generations, procs, self.state.current_generation)
        for n in gone:
            g = self.state.generations.pop(n)
            self._inputs.pop(n, None)
            log.info("generation pruned generation=%d worker=%s: worker gone", n, g.worker_pid)
        self.store.remove_configs(gone)
        self._persist()
        self.enforce_old_workers_max(procs)

    def enforce_old_workers_max(self, procs: ProcList) -> list[int]:
        limit = self.settings.old_workers.max
        self._terminated &= {p.pid for p in procs.old_workers}
        victims = [p for p in old_workers_over_max(procs, limit) if p.pid not in self._terminated]
        by_pid = {g.worker_pid: n for n, g in self.state.generations.items()}
        for proc in victims:
            log.warning(
                "old worker pid=%d generation=%s SIGTERM: %d old workers alive > old_workers.max=%d, oldest first",
                proc.pid, by_pid.get(proc.pid), len(procs.old_workers), limit,
            )
            self._terminated.add(proc.pid)
            try:
                # Only a PID `show proc` just listed as an old worker of our master is signalled.
                if psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
                    os.kill(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return [p.pid for p in victims]

    def _old_count(self) -> int | None:
        return len(self.last_procs.old_workers) if self.last_procs is not None else None
