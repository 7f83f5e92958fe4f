"""Starting from what is there: the first start, a master (re)started on the config on disk, the
adoption of a running master, runtime_dir deleted under us; the Reloader acts on what each finds."""

from __future__ import annotations

import logging

from ..effective import (
    Effective,
    RenderedConfigError,
    check_effective,
    load_effective,
    off_the_loop,
    prepare_runtime_dir,
    read_rendered,
    sha256_text,
    start_check,
)
from ..files import RuntimeDirLock
from ..haproxy.answers import ProcList
from ..haproxy.config import Config
from ..master.process import MasterError, MasterProcess
from ..master.processes import process_started_at
from ..settings import Settings
from ..state import Generation, ReloadResult
from .decisions import EXPECTED_IO_ERRORS, Runs, io_error_line, one_line
from .records import ConfigOnDisk, GenerationBook, LoadedConfig, loaded_pending, plan_rebuild
from .watch import inputs_digest

log = logging.getLogger(__package__)


class Recovery:
    """Owns nothing: what it finds goes to the generations book and the config on disk."""

    def __init__(self, settings: Settings, master: MasterProcess, book: GenerationBook, disk: ConfigOnDisk) -> None:
        self.settings, self.master, self.book, self.disk = settings, master, book, disk

    async def take_back(self, pid: int) -> ProcList | None:
        """Our master `pid` lives but its socket is gone: it re-executes on the rendered config, once
        valid, and is adopted; else MasterError: a second HAProxy must never start beside it."""
        settings = self.settings
        log.warning("haproxy master pid=%d lives but %s was removed: taking it back on the rendered config",
                    pid, settings.haproxy.master_socket_path)
        try:
            effective = await off_the_loop(lambda: load_effective(settings))
        except Exception as exc:
            raise MasterError(f"haproxy master pid={pid} lost its socket and the rendered config cannot be "
                              f"used ({exc}): refusing to start a second HAProxy") from None
        ok, message = await check_effective(self.settings.haproxy, effective)
        if not ok:
            raise MasterError(f"haproxy master pid={pid} lost its socket and the rendered config is invalid "
                              f"({one_line(message, 200)}): refusing to start a second HAProxy")
        self.disk.write(effective)
        return await self.master.take_back(pid)

    async def first_start(self, effective: Effective, inputs: str) -> tuple[ReloadResult, str] | None:
        """No master yet: validate, write, let the master start on it; else (result, error)."""
        ok, message = await check_effective(self.settings.haproxy, effective)
        if not ok:
            log.error("initial config invalid: %s", one_line(message))
            return "invalid", message
        try:
            self.disk.write(effective)
        except OSError as exc:
            if exc.errno not in EXPECTED_IO_ERRORS:
                raise
            error = f"cannot write the effective config for haproxy: {io_error_line(exc)}"
            log.error("reload failed: %s", error)
            return "failed", error
        self.disk.worker_runs(LoadedConfig.of(effective, inputs))
        log.info("initial config valid sha256=%s: starting haproxy", effective.sha256[:12])
        self.master.request_start()
        return None

    async def start_on_previous(self) -> bool:
        """Start HAProxy on the effective config on disk, the last good one, if it is valid."""
        h = self.settings.haproxy
        fallback = self.disk.previous()
        if fallback is None:
            return False
        ok, _ = await (await start_check(h.binary, fallback, h.runtime_dir)).verdict()
        if not ok:
            return False
        log.warning("starting haproxy on the previous effective config %s until the rendered one can be loaded",
                    h.effective_config)
        self.disk.worker_runs(self.disk.loaded_text(fallback, "", None), on_disk=True)
        self.master.request_start()
        return True

    def master_started(self, procs: ProcList, held: LoadedConfig | None) -> Generation:
        """A master we started runs the config on disk: `held`, a reload's never confirmed, if any."""
        worker = procs.current_worker
        assert worker is not None
        disk = self.disk
        loaded = held or disk.loaded
        if loaded is None:
            loaded = disk.loaded_text(disk.previous() or "", "", self._unknown_inputs())
        disk.worker_runs(loaded)
        model = loaded.model if loaded.model is not None else Config.parse(loaded.text)
        # The workers of a previous master are gone: their generations are pruned.
        generation = self.book.worker_started(worker.pid, model, loaded, procs)
        log.info("generation started generation=%d worker=%d (master start)", generation.number, worker.pid)
        return generation

    def rebuild(self, procs: ProcList) -> Generation | None:
        """After adoption: generations from generations.json + generations/*.cfg, matched to `show proc`."""
        book, disk, h = self.book, self.disk, self.settings.haproxy
        snapshot = book.store.load()
        plan = plan_rebuild(snapshot, procs)
        book.last_number = snapshot.last_number if snapshot else 0
        kept: dict[int, Generation] = {}
        for record in plan.keep:
            text = book.store.read_config(record.number)
            if text is None:
                log.warning("generation %d: %s missing; worker %s runs an unknown config",
                            record.number, book.store.config_path(record.number), record.worker_pid)
                continue
            try:
                model = Config.parse(text)
            except Exception as exc:
                log.warning("generation %d: cannot parse %s: %s", record.number,
                            book.store.config_path(record.number), exc)
                continue
            kept[record.number] = book.kept(record, model)
        worker = procs.current_worker
        current = kept.get(plan.current.number) if plan.current else None
        on_disk = disk.previous()
        if current is None and worker is not None:
            # Died between HAProxy starting a worker and recording it: the worker runs what was on disk.
            text = on_disk or ""
            pending = snapshot.pending if snapshot else None
            if pending is not None and loaded_pending(pending, procs, sha256_text(text)):
                log.info("current worker %d has no recorded generation: started by the reload sent before "
                         "the daemon stopped, it runs %s", worker.pid, h.effective_config)
                rendered, inputs = pending.rendered_sha256, pending.inputs_sha256
            else:
                log.warning("current worker %d has no recorded generation: assuming it runs %s",
                            worker.pid, h.effective_config)
                rendered, inputs = "", self._unknown_inputs()
            current = book.worker_started(worker.pid, Config.parse(text), disk.loaded_text(text, rendered, inputs),
                                          started_at=process_started_at(worker.pid))
        if current is None:
            return None
        book.state.publish_generation(current, current=True)
        text = book.store.read_config(current.number) or on_disk or ""
        if on_disk != text:
            # Died mid-reload with a config on disk that never took: disk must be what runs.
            log.warning("%s differs from what worker %s runs: restored", h.effective_config, current.worker_pid)
        loaded = disk.loaded_text(text, current.rendered_sha256, current.inputs_sha256)
        disk.worker_runs(loaded, on_disk=on_disk == text)
        for record in plan.drop:
            log.info("generation pruned generation=%d worker=%s: worker gone", record.number, record.worker_pid)
        book.store.remove_configs([r.number for r in plan.drop])
        book.observe(procs)
        log.info(
            "generations rebuilt current=%d worker=%s kept=%s unknown_old_workers=%s",
            current.number, current.worker_pid, sorted(book.state.generations), list(plan.unknown_old_pids),
        )
        return current

    def goal_since_loaded(self) -> Runs | None:
        """What the node should run when its inputs are as the current worker loaded them; else None."""
        loaded = self.disk.loaded
        h = self.settings.haproxy
        try:
            rendered_sha = sha256_text(read_rendered(h.config, h.max_config_bytes))
        except RenderedConfigError:
            rendered_sha = None
        if loaded is None or rendered_sha != loaded.rendered_sha256 or inputs_digest(h.watch) != loaded.inputs_sha256:
            return None
        return loaded.sha256, loaded.inputs_sha256

    def restore_runtime_dir(self, lock: RuntimeDirLock | None) -> bool:
        """Recreate what the daemon owns in runtime_dir; False when nothing runs to put back."""
        prepare_runtime_dir(self.settings)
        if lock is not None:
            lock.renew()
        if not self.disk.rewrite() or self.disk.loaded is None:
            return False
        self.book.rewrite_all()
        return True

    def _unknown_inputs(self) -> str | None:
        # A loading nobody recorded: with no file watched the digest is known; else the next change reloads.
        return None if self.settings.haproxy.watch else inputs_digest(())
