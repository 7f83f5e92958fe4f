"""Starting from what is there: the first start, a master (re)started on the config on disk, the
adoption of a running master after a daemon restart, and runtime_dir deleted under us."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ..effective import (
    Effective,
    RenderedConfigError,
    load_effective,
    off_the_loop,
    prepare_runtime_dir,
    read_rendered,
    sha256_text,
    start_effective_check,
    validate,
    write_effective,
)
from ..generations import loaded_pending, plan_rebuild
from ..haproxy.api import ProcList
from ..haproxy.config import Config
from ..haproxy.inject import SLOT_TABLE_PREFIX, SlotTable
from ..master import MasterError
from ..master.procfs import process_started_at
from ..state import Generation, ReloadRecord
from .base import LoadedConfig
from .convergence import Convergence
from .problems import io_error_line, one_line
from .watch import inputs_digest

log = logging.getLogger(__package__)


class Recovery(Convergence):
    async def take_back(self, pid: int) -> ProcList | None:
        """Our master `pid` lives but its socket file is gone (runtime_dir deleted while no daemon
        ran). What it runs is unknown; the effective config of the rendered config, once valid,
        goes on disk for it to re-execute on, and it is adopted. MasterError when there is no
        valid config to give it: a second HAProxy must never start beside it."""
        h = self.settings.haproxy
        log.warning("haproxy master pid=%d lives but %s was removed: taking it back on the rendered config",
                    pid, h.master_socket_path)
        settings = self.settings
        try:
            effective = await off_the_loop(lambda: load_effective(settings))
        except Exception as exc:
            raise MasterError(f"haproxy master pid={pid} lost its socket and the rendered config cannot be "
                              f"used ({exc}): refusing to start a second HAProxy") from None
        ok, message = await (await start_effective_check(h.binary, effective, h.runtime_dir)).verdict()
        if not ok:
            raise MasterError(f"haproxy master pid={pid} lost its socket and the rendered config is invalid "
                              f"({one_line(message, 200)}): refusing to start a second HAProxy")
        write_effective(h.effective_config, effective)
        self._on_disk_sha = effective.sha256
        return await self.master.take_back(pid)

    async def _first_start(self, effective: Effective, inputs: str, started: float) -> ReloadRecord | None:
        """No master yet: validate, write the effective config, and let the master start on it."""
        h = self.settings.haproxy
        ok, message = await (await start_effective_check(h.binary, effective, h.runtime_dir)).verdict()
        if ok:
            write_effective(h.effective_config, effective)
            self._on_disk_sha = effective.sha256
            self.loaded = LoadedConfig.of(effective, inputs)
            log.info("initial config valid sha256=%s: starting haproxy", effective.sha256[:12])
            self.master.request_start()
            return None
        log.error("initial config invalid: %s", one_line(message))
        record = self._record("invalid", started, message)
        fallback = self._previous_effective()
        if fallback is not None:
            ok, _ = await validate(h.binary, fallback, h.runtime_dir)
            if ok:
                log.warning("starting haproxy on the previous effective config %s until a valid one is rendered",
                            h.effective_config)
                self.loaded = LoadedConfig(fallback, "", None, self._slot_table_named(fallback))
                self._on_disk_sha = sha256_text(fallback)
                self.master.request_start()
                return record
        log.error("no valid config to start haproxy with: waiting for %s to change", h.config)
        self.notifier.status(f"waiting for a valid config: {one_line(message, 200)}")
        return record

    def _previous_effective(self) -> str | None:
        try:
            return self.settings.haproxy.effective_config.read_text()
        except (OSError, UnicodeDecodeError):
            return None

    async def on_master_started(self, procs: ProcList) -> Generation | None:
        """A master we started (first start or restart) runs the effective config on disk."""
        worker = procs.current_worker
        if worker is None:
            return None
        # Called by MasterProcess.run() with master.lock held, before any reload can run.
        if self._unconfirmed is not None:
            # It started on the disk's config: the one whose reload was never confirmed.
            self.loaded = LoadedConfig.of(self._unconfirmed.effective, self._unconfirmed.inputs)
            self._unconfirmed = None
        loaded = self.loaded
        if loaded is None:
            text = self._previous_effective() or ""
            loaded = self.loaded = LoadedConfig(text, "", self._unknown_inputs(), self._slot_table_named(text))
        generation = self._new_generation(
            Config.parse(loaded.text), loaded.sha256, loaded.rendered_sha256, loaded.inputs_sha256, worker.pid
        )
        self._write_generation_config(generation.number, loaded.text)
        log.info("generation started generation=%d worker=%d (master start)", generation.number, worker.pid)
        self._observe(procs)  # the workers of a previous master are gone: prune their generations
        self._check_inputs_since_loaded("the master was starting")
        self._assess(None)
        return generation

    def rebuild(self, procs: ProcList) -> Generation | None:
        """After adoption: generations from generations.json + generations/*.cfg, matched to `show proc`."""
        snapshot = self.store.load()
        plan = plan_rebuild(snapshot, procs)
        self._last_number = snapshot.last_number if snapshot else 0
        for record in plan.keep:
            text = self.store.read_config(record.number)
            if text is None:
                log.warning("generation %d: %s missing; worker %s runs an unknown config",
                            record.number, self.store.config_path(record.number), record.worker_pid)
                continue
            try:
                model = Config.parse(text)
            except Exception as exc:
                log.warning("generation %d: cannot parse %s: %s", record.number,
                            self.store.config_path(record.number), exc)
                continue
            self.state.generations[record.number] = Generation(
                record.number, model, record.effective_sha256, record.rendered_sha256,
                record.started_at, record.worker_pid,
            )
            self._inputs[record.number] = record.inputs_sha256
            self._last_number = max(self._last_number, record.number)
        worker = procs.current_worker
        current = self.state.generations.get(plan.current.number) if plan.current else None
        disk = self._previous_effective()
        if current is None and worker is not None:
            # Died between HAProxy starting a worker and recording it: the worker runs what was on disk.
            text = disk or ""
            pending = snapshot.pending if snapshot else None
            if pending is not None and loaded_pending(pending, procs, sha256_text(text)):
                log.info("current worker %d has no recorded generation: started by the reload sent before "
                         "the daemon stopped, it runs %s", worker.pid, self.settings.haproxy.effective_config)
                rendered, inputs = pending.rendered_sha256, pending.inputs_sha256
            else:
                log.warning("current worker %d has no recorded generation: assuming it runs %s",
                            worker.pid, self.settings.haproxy.effective_config)
                rendered, inputs = "", self._unknown_inputs()
            current = self._new_generation(Config.parse(text), sha256_text(text), rendered, inputs, worker.pid)
            current.started_at = process_started_at(worker.pid) or current.started_at
            self._write_generation_config(current.number, text)
        if current is None:
            return None
        self.state.current_generation = current.number
        self.state.last_good_sha256 = current.effective_sha256
        text = self.store.read_config(current.number) or disk or ""
        if disk != text:
            # Died mid-reload with a config on disk that never took: disk must be what runs.
            log.warning("%s differs from what worker %s runs: restored", self.settings.haproxy.effective_config,
                        current.worker_pid)
        else:
            self._on_disk_sha = sha256_text(text)
        self.loaded = LoadedConfig(
            text, current.rendered_sha256, self._inputs.get(current.number), self._slot_table_named(text)
        )
        self._write_back()
        for record in plan.drop:
            log.info("generation pruned generation=%d worker=%s: worker gone", record.number, record.worker_pid)
        self.store.remove_configs([r.number for r in plan.drop])
        self._observe(procs)
        log.info(
            "generations rebuilt current=%d worker=%s kept=%s unknown_old_workers=%s",
            current.number, current.worker_pid, sorted(self.state.generations), list(plan.unknown_old_pids),
        )
        self._check_inputs_since_loaded("no daemon was watching")
        return current

    def _check_inputs_since_loaded(self, why: str) -> None:
        """Schedule a change when the rendered config or a watched file differs from what was loaded."""
        loaded = self.loaded
        try:
            h = self.settings.haproxy
            rendered_sha = sha256_text(read_rendered(h.config, h.max_config_bytes))
        except RenderedConfigError:
            rendered_sha = None
        if (
            loaded is None
            or rendered_sha != loaded.rendered_sha256
            or inputs_digest(self.settings.haproxy.watch) != loaded.inputs_sha256
        ):
            log.info("inputs changed while %s: change scheduled", why)
            self.changed()
        elif loaded is not None:
            self._goal = (loaded.sha256, loaded.inputs_sha256)

    def _unknown_inputs(self) -> str | None:
        """The watched files' digest for a config whose loading nobody recorded: known when no
        file is watched (there is nothing else it could depend on), else unknown (None), and
        the next change reloads to be sure."""
        return None if self.settings.haproxy.watch else inputs_digest(())

    def _slot_table_named(self, text: str) -> SlotTable | None:
        """The slot table file a config names, read from runtime_dir (to write it back with it)."""
        match = re.search(rf"{re.escape(str(self.settings.haproxy.runtime_dir))}/{SLOT_TABLE_PREFIX}[0-9a-f]+\.map",
                          text)
        if match is None:
            return None
        path = Path(match[0])
        try:
            return SlotTable(path, path.read_text())
        except (OSError, UnicodeDecodeError):
            return None

    async def _recover_runtime_dir(self) -> None:
        """The master's socket is gone (runtime_dir deleted under us): recreate what the daemon
        owns, then make the master re-execute, which binds its socket again, with master.lock held."""
        h = self.settings.haproxy
        if self.state.master_socket_ok:
            log.error("%s is missing (runtime_dir deleted?): recreating %s, then making master pid=%s bind it again",
                      h.master_socket_path, h.runtime_dir, self.master.pid)
            self.state.master_socket_ok = False
            self._assess(None)
        try:
            prepare_runtime_dir(self.settings)
            if self.runtime_lock is not None:
                self.runtime_lock.renew()
            self._on_disk_sha = None
            self._write_back()
            if self._on_disk_sha is None:
                return
            for number, generation in self.state.generations.items():
                self._write_generation_config(number, generation.model.render())
            self._persisted = None
            self._persist()
        except OSError as exc:
            error = io_error_line(exc)
            self.problems.happened("runtime_dir", error, f"cannot recreate {h.runtime_dir}: {error}")
            return
        self.problems.over("runtime_dir")
        before = self.last_procs
        procs = await self.master.reexec(before)
        if procs is None:
            return
        self.state.master_socket_ok = True
        generation = await self.on_master_started(procs)
        log.info("runtime_dir recreated: master pid=%s answers on %s again; generation=%s worker=%s",
                 self.master.pid, h.master_socket_path, generation.number if generation else None,
                 generation.worker_pid if generation else None)
