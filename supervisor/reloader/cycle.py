"""One change: load the rendered config, `haproxy -c` it, then apply it at runtime or reload,
and record what runs."""

from __future__ import annotations

import asyncio
import logging
import time

from ..effective import (
    Effective,
    RenderedConfigError,
    load_effective,
    off_the_loop,
    start_effective_check,
    write_effective,
)
from ..gcpolicy import collector_paused, settle_after_reload
from ..generations import PendingReload
from ..haproxy.api import CLIError, ProcList
from ..haproxy.config import Config
from ..master.readiness import bind_ports
from ..notify import summary_line
from ..state import Generation, ReloadRecord
from ..writers import WriterBusy
from .base import LoadedConfig
from .confirm import Confirmation, Verdict
from .problems import io_error_line, one_line
from .watch import inputs_digest

log = logging.getLogger(__package__)

WRITER_POLL_S = 0.05  # how often a file being written is looked at again


class ReloadCycle(Confirmation):
    async def apply_change(self, force: bool, reason: str) -> ReloadRecord | None:
        started = time.monotonic()
        if self.master.stopping:
            return None
        self._goal = None  # read afresh: until then, what the node should run is not known
        try:
            effective = await self._load_whole()
        except RenderedConfigError as exc:
            if exc.missing and not self.master.wanted:
                # A controller that has rendered nothing yet (a Ray node before Ray starts) is no
                # bad input, and nothing serves that a record would warn about: its write is the change.
                log.info("waiting for the rendered config: %s", exc)
                return None
            log.error("reload invalid: %s", exc)
            return self._record("invalid", started, str(exc))
        except OSError:  # the daemon short of descriptors or memory: a passing failure, retried
            raise
        except Exception as exc:  # our parser choking on input must not take the daemon down
            error = f"{self.settings.haproxy.config}: cannot build the effective config: {exc}"
            log.error("reload invalid: %s", error)
            return self._record("invalid", started, error)
        watch = self.settings.haproxy.watch
        inputs = await off_the_loop(lambda: inputs_digest(watch))  # maps and certificates can be big
        self.state.rendered_sha256 = effective.rendered_sha256
        self._goal = (effective.sha256, inputs)
        if not self.master.wanted:
            return await self._first_start(effective, inputs, started)
        while True:
            await self.master.wait_up()
            async with self.master.lock:
                if self.master.stopping:
                    return None
                if not self.master.up:
                    continue
                # Timed (and reload.timeout_s counted) from here, not from waiting for the lock.
                with collector_paused():
                    return await self._change_locked(effective, inputs, force, reason, time.monotonic())

    async def _load_whole(self) -> Effective:
        """The rendered config's effective config, read once its writer is done: while a writer
        holds its lock or the file open for writing, wait (the change stays not converged)."""
        settings = self.settings
        waiting_since: float | None = None
        while True:
            try:
                with collector_paused():  # gcpolicy: no collection on the way to steering
                    effective = await off_the_loop(lambda: load_effective(settings))
            except WriterBusy as exc:
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    log.info("reload waits: %s", exc)
                await asyncio.sleep(WRITER_POLL_S)
                continue
            if waiting_since is not None:
                log.info("reload: the writer is done after %.1fs", time.monotonic() - waiting_since)
            return effective

    async def _change_locked(
        self, effective: Effective, inputs: str, force: bool, reason: str, started: float
    ) -> ReloadRecord:
        if self._unconfirmed is not None:
            # Settle the previous reload first: a second one must not be sent while HAProxy may
            # still be loading the first.
            try:
                loading = await self._settle(await self._show_proc_until(started + self.settings.reload.timeout_s))
            except CLIError as exc:
                self.cli_failed()
                loading, error = True, f"HAProxy has not settled the previous reload: {exc}"
            else:
                error = "HAProxy is still loading the previous reload (its new worker is not ready yet)"
            if loading:
                # Nothing was sent, and nothing failed: the outcome is still HAProxy's to give.
                log.warning("reload unknown: %s", error)
                return self._record("unknown", started, error)
            if self._unconfirmed is not None:
                log.info("reload still unconfirmed after %.1fs, and no new worker listed: sending it again",
                         time.monotonic() - self._unconfirmed.sent)
        current = self.state.current
        unchanged = (
            current is not None
            and effective.sha256 == current.effective_sha256
            and inputs == self._inputs.get(current.number)
        )
        if unchanged and not force:
            log.info("reload skipped_unchanged sha256=%s reason=%s", effective.sha256[:12], reason)
            return self._record("skipped_unchanged", started)
        check = await start_effective_check(self.settings.haproxy.binary, effective, self.settings.haproxy.runtime_dir)
        # `haproxy -c` takes a core of its own for a while (a quarter of a second at 10,000
        # servers): work out the steering the next config needs meanwhile, so that only its
        # pushes are left once the check passes. Nothing is pushed before the verdict.
        try:
            await self._call_hook("prepare", effective.effective_model)
        finally:
            ok, message = await check.verdict()  # reaps `haproxy -c` whatever happened
        if not ok:
            log.error("reload invalid: %s", one_line(message))
            record = self._record("invalid", started, message)
            self.notifier.status(summary_line(self.state))
            return record
        model = effective.effective_model
        if (
            self.runtime_apply is not None
            and current is not None
            and not force
            and inputs == self._inputs.get(current.number)
        ):
            try:
                applied = await self.runtime_apply(current, model, effective)
            except Exception:
                log.exception("runtime apply raised; reloading instead")
                applied = False
            if applied:
                return await self._runtime_applied(current, model, effective, inputs, started)
            if current.model is model:
                self._ran_in_part(current, effective)
        return await self._reload(effective, model, inputs, reason, started)

    async def _runtime_applied(
        self, current: Generation, model: Config, effective: Effective, inputs: str, started: float
    ) -> ReloadRecord:
        current.model = model
        current.effective_sha256 = effective.sha256
        current.rendered_sha256 = effective.rendered_sha256
        self.loaded = LoadedConfig.of(effective, inputs)
        self.state.last_good_sha256 = effective.sha256
        # HAProxy runs the change already: a failed write is retried by housekeeping, not undone.
        self._write_back()
        self._write_generation_config(current.number, effective.text)
        self._persist()
        self._remove_stale_slot_tables(effective)
        record = self._record("runtime_applied", started)
        log.info(
            "reload runtime_applied generation=%d worker=%s duration_ms=%d",
            current.number, current.worker_pid, record.duration_ms,
        )
        await self._call_hook("refresh")
        self.notifier.status(summary_line(self.state, self._old_count()))
        return record

    def _ran_in_part(self, current: Generation, effective: Effective) -> None:
        """A runtime apply added the new servers and then fell back to a reload (a `del server`
        refused): the worker runs the new config's servers, plus removed ones left in maint.
        Its generation records that, for its steering once it is old and for a daemon restart."""
        current.effective_sha256 = effective.sha256
        current.rendered_sha256 = effective.rendered_sha256
        self._write_generation_config(current.number, effective.text)
        self._persist()

    async def _reload(
        self, effective: Effective, model: Config, inputs: str, reason: str, started: float
    ) -> ReloadRecord:
        deadline = started + self.settings.reload.timeout_s
        try:
            before = await self._show_proc_until(deadline)
        except CLIError as exc:
            self.cli_failed()
            log.error("reload failed: %s", exc)
            return self._record("failed", started, str(exc))
        await self._call_hook("before_reload", model)
        verdict: Verdict = "pending"
        try:
            current = self.state.current
            if self.save_server_state is not None and current is not None:
                try:
                    await self.save_server_state(current, model, self.settings.haproxy.server_state_file)
                except OSError as exc:
                    log.error("saving server state failed: %s; the new worker starts from the config",
                              io_error_line(exc))
                except Exception:  # a missing state file costs states, not the reload
                    log.exception("saving server state failed; the new worker starts from the config")
            self.notifier.reloading(f"reloading: {reason}")
            if before.master is not None:
                # Recorded before it is sent: a daemon killed before HAProxy answers leaves the
                # next one what the new worker was given, so adopting it costs no reload.
                self._pending = PendingReload(
                    effective.sha256, effective.rendered_sha256, inputs, before.master.pid, before.master.reloads
                )
                self._persist()
            write_effective(self.settings.haproxy.effective_config, effective)
            self._on_disk_sha = effective.sha256
            self.scheduler.reloaded(time.monotonic())
            error: str | None = None
            after: ProcList | None = None
            try:
                # Bounded by reload.timeout_s: a stopped master accepts the connection and never answers.
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    answer = await self.cli.reload()
                if answer.success is False:
                    verdict, error = "failed", answer.log or "reload answered Success=0"
                    self._refused = True
            except (CLIError, TimeoutError) as exc:
                # 2.6 closes the connection as the master re-executes; `show proc` decides.
                log.debug("reload command: %s", exc or "timed out")
            if verdict == "pending":
                verdict, after, error = await self._confirm(before, deadline, bind_ports(model))
            if verdict == "ok" and after is not None and after.current_worker is not None:
                record = self._reload_ok(effective, inputs, after, started)
            elif verdict == "unknown":
                record = self._reload_unknown(before, effective, inputs, error or "unconfirmed", started, model)
            else:
                record = self._reload_failed(before, error or "reload failed", started)
        finally:
            await self._call_hook("after_reload", verdict == "ok")
        self.notifier.ready(summary_line(self.state, self._old_count()))
        if verdict == "ok":
            settle_after_reload()  # after the old workers are steered, never before
        return record

    def _reload_ok(self, effective: Effective, inputs: str, after: ProcList, started: float) -> ReloadRecord:
        generation = self._loaded_by(effective, inputs, after)
        record = self._record("ok", started)
        log.info(
            "reload ok generation=%d worker=%s duration_ms=%d",
            generation.number, generation.worker_pid, record.duration_ms,
        )
        return record

    def _reload_failed(self, before: ProcList, error: str, started: float) -> ReloadRecord:
        restored = self._restore_loaded()
        current = before.current_worker
        record = self._record("failed", started, error)
        log.error(
            "reload failed duration_ms=%d: %s; worker %s keeps serving; %s %s",
            record.duration_ms, one_line(error), current.pid if current else None,
            self.settings.haproxy.effective_config,
            "restored to the last good config" if restored else "to be restored to the last good config",
        )
        return record
