"""One change, with master.lock held: settle a reload still unconfirmed, decide (skip, runtime
apply, reload), `haproxy -c` it, then apply it at runtime or reload, and record what runs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..effective import Effective, load_effective, off_the_loop, start_effective_check
from ..eventloop import collector_paused, settle_after_reload
from ..files import WriterBusy
from ..haproxy.answers import ProcList
from ..haproxy.api import CLIError
from ..haproxy.config import Config
from ..haproxy.server_state import clear_server_state
from ..master.readiness import bind_ports
from ..notify import summary_line
from ..settings import Settings
from ..state import Generation
from .confirm import Confirmed, Settled
from .decisions import EXPECTED_IO_ERRORS, Attempt, decide_change, io_error_line, one_line
from .hooks import RuntimeApply, SaveServerState, call_hook
from .parts import Parts
from .records import LoadedConfig, PendingReload

log = logging.getLogger(__package__)

WRITER_POLL_S = 0.05  # how often a file being written is looked at again


async def load_whole(settings: Settings) -> Effective:
    """The rendered config's effective config, read once its writer is done: while a writer
    holds its lock or the file open for writing, wait (the change stays not converged)."""
    waiting_since: float | None = None
    while True:
        try:
            with collector_paused():  # eventloop: no collection on the way to steering
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


async def guarded(parts: Parts, cycle: Awaitable[Attempt | None]) -> Attempt | None:
    """One cycle failing on I/O (disk full, permissions) or a bug is logged and recorded; the
    daemon goes on watching, HAProxy goes on serving the last good config."""
    started = time.monotonic()
    try:
        return await cycle
    except OSError as exc:
        if exc.errno not in EXPECTED_IO_ERRORS:
            log.exception("reload failed: the cycle raised %s", type(exc).__name__)
            return Attempt(parts.record("failed", started, f"{type(exc).__name__}: {exc}"))
        error = io_error_line(exc)
        log.error("reload failed: %s", error)
        return Attempt(parts.record("failed", started, error))
    except Exception as exc:
        log.exception("reload failed: the cycle raised %s", type(exc).__name__)
        return Attempt(parts.record("failed", started, f"{type(exc).__name__}: {exc}"))


class Cycle:
    """Takes one change to the master; owns nothing: what it learns goes to the parts' owners."""

    def __init__(
        self, parts: Parts, runtime_apply: RuntimeApply | None, save_server_state: SaveServerState | None,
        settled: Callable[[Settled, ProcList], Awaitable[None]], cli_failed: Callable[[], None],
    ) -> None:
        self.parts = parts
        self.runtime_apply = runtime_apply
        self.save_server_state = save_server_state
        self.settled = settled  # the reloader's handler of a reload settled late
        self.cli_failed = cli_failed

    async def change(self, effective: Effective, inputs: str, force: bool, reason: str, started: float) -> Attempt:
        p = self.parts
        if p.confirmation.unconfirmed is not None:
            waiting = await self._settle_first(started)
            if waiting is not None:
                return waiting
        current = p.state.current
        runs = None if current is None else (current.effective_sha256, current.inputs_sha256)
        action = decide_change(runs, (effective.sha256, inputs), force=force,
                               runtime_apply=self.runtime_apply is not None)
        if action == "skip":
            log.info("reload skipped_unchanged sha256=%s reason=%s", effective.sha256[:12], reason)
            return Attempt(p.record("skipped_unchanged", started))
        h = p.settings.haproxy
        check = await start_effective_check(h.binary, effective, h.runtime_dir, h.config)
        # `haproxy -c` takes a core of its own for a while (a quarter of a second at 10,000
        # servers): work out the steering the next config needs meanwhile, so that only its
        # pushes are left once the check passes. Nothing is pushed before the verdict.
        plan = None
        try:
            plan = await call_hook(p.hooks, "prepare", effective)
        finally:
            ok, message = await check.verdict()  # reaps `haproxy -c` whatever happened
        if not ok:
            log.error("reload invalid: %s", one_line(message))
            record = p.record("invalid", started, message)
            p.notifier.status(summary_line(p.state))
            return Attempt(record)
        model = effective.effective_model
        if action == "runtime" and current is not None and self.runtime_apply is not None:
            try:
                outcome = await self.runtime_apply(current, model, effective)
            except Exception:
                log.exception("runtime apply raised; reloading instead")
            else:
                if outcome.applied:
                    return await self._runtime_applied(current, outcome.runs or model, effective, inputs, started)
                if outcome.runs is not None:
                    # The new servers went in before it fell back to a reload (a `del server`
                    # refused): the worker runs them, plus removed ones left in maint. Its
                    # generation says so, for its steering once it is old and for a daemon restart.
                    p.book.ran(current, outcome.runs, effective, whole=False)
        return await self._reload(effective, model, inputs, reason, started, plan)

    async def _settle_first(self, started: float) -> Attempt | None:
        """A second reload must not be sent while HAProxy may still be loading the first: settle
        it. An attempt when it cannot be (nothing sent, nothing failed: the outcome is still
        HAProxy's to give), else None."""
        p = self.parts
        loading = True
        try:
            procs = await p.confirmation.show_proc_until(started + p.settings.reload.timeout_s)
        except CLIError as exc:
            self.cli_failed()
            error = f"HAProxy has not settled the previous reload: {exc}"
        else:
            settled = await p.confirmation.settle(procs)
            if settled is not None:
                await self.settled(settled, procs)
            loading = settled is not None and settled.verdict == "loading"
            error = "HAProxy is still loading the previous reload (its new worker is not ready yet)"
        if loading:
            log.warning("reload unknown: %s", error)
            return Attempt(p.record("unknown", started, error))
        held = p.confirmation.unconfirmed
        if held is not None:
            log.info("reload still unconfirmed after %.1fs, and no new worker listed: sending it again",
                     time.monotonic() - held.sent)
        return None

    async def _runtime_applied(
        self, current: Generation, runs: Config, effective: Effective, inputs: str, started: float
    ) -> Attempt:
        p = self.parts
        p.disk.runs(LoadedConfig.of(effective, inputs))
        # HAProxy runs the change already: a failed write is retried by housekeeping, not undone.
        p.disk.write_back()
        generation = p.book.ran(current, runs, effective, whole=True)
        p.disk.remove_stale_slot_tables(effective)
        record = p.record("runtime_applied", started)
        log.info(
            "reload runtime_applied generation=%d worker=%s duration_ms=%d",
            generation.number, generation.worker_pid, record.duration_ms,
        )
        await call_hook(p.hooks, "refresh")
        p.notifier.status(summary_line(p.state, p.book.old_count()))
        return Attempt(record)

    async def _save_server_state(self, model: Config) -> None:
        current = self.parts.state.current
        if self.save_server_state is None or current is None:
            return
        path = self.parts.settings.haproxy.server_state_file
        try:
            await self.save_server_state(current, model, path)
            self.parts.state.publish_write("server-state file", None)
        except OSError as exc:
            # A previous reload's file must not hand the new worker states that are no longer true.
            error = io_error_line(exc)
            cleared = clear_server_state(path)
            log.error("saving server state failed: %s; the new worker starts from the config", cleared or error)
            self.parts.state.publish_write("server-state file", cleared or error)
        except Exception:  # a missing state file costs states, not the reload
            log.exception("saving server state failed; the new worker starts from the config")

    async def _reload(
        self, effective: Effective, model: Config, inputs: str, reason: str, started: float, plan: object
    ) -> Attempt:
        p = self.parts
        deadline = started + p.settings.reload.timeout_s
        try:
            before = await p.confirmation.show_proc_until(deadline)
        except CLIError as exc:
            self.cli_failed()
            log.error("reload failed: %s", exc)
            return Attempt(p.record("failed", started, str(exc)))
        plan = await call_hook(p.hooks, "before_reload", plan)
        confirmed = Confirmed("pending", None)
        try:
            await self._save_server_state(model)
            p.notifier.reloading(f"reloading: {reason}")
            if before.master is not None:
                p.book.sending(PendingReload(
                    effective.sha256, effective.rendered_sha256, inputs, before.master.pid, before.master.reloads
                ))
            p.disk.write(effective)
            p.scheduler.reloaded(time.monotonic())
            try:
                # Bounded by reload.timeout_s: a stopped master accepts the connection and never answers.
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    answer = await p.cli.reload()
                if answer.success is False:
                    confirmed = Confirmed("failed", None, answer.log or "reload answered Success=0", refused=True)
            except (CLIError, TimeoutError) as exc:
                # 2.6 closes the connection as the master re-executes; `show proc` decides.
                log.debug("reload command: %s", exc or "timed out")
            if confirmed.verdict == "pending":
                confirmed = await p.confirmation.confirm(before, deadline, bind_ports(model))
            after = confirmed.after
            if confirmed.verdict == "ok" and after is not None and after.current_worker is not None:
                attempt = self._reload_ok(effective, inputs, after, started)
            elif confirmed.verdict == "unknown":
                attempt = self._reload_unknown(before, effective, inputs, confirmed.error or "unconfirmed",
                                               started, model)
            else:
                attempt = self._reload_failed(before, confirmed, started)
        finally:
            await call_hook(p.hooks, "after_reload", plan, confirmed.verdict == "ok")
        p.notifier.ready(summary_line(p.state, p.book.old_count()))
        if confirmed.verdict == "ok":
            settle_after_reload()  # after the old workers are steered, never before
        return attempt

    def _reload_ok(self, effective: Effective, inputs: str, after: ProcList, started: float) -> Attempt:
        generation = self.parts.loaded_by(effective, inputs, after)
        record = self.parts.record("ok", started)
        log.info(
            "reload ok generation=%d worker=%s duration_ms=%d",
            generation.number, generation.worker_pid, record.duration_ms,
        )
        return Attempt(record)

    def _reload_unknown(
        self, before: ProcList, effective: Effective, inputs: str, error: str, started: float, model: Config
    ) -> Attempt:
        p = self.parts
        p.confirmation.hold(before, effective, inputs, bind_ports(model))
        record = p.record("unknown", started, error)
        log.warning(
            "reload unknown duration_ms=%d: %s; HAProxy may still be loading it: %s keeps the new config "
            "and `show proc` settles it",
            record.duration_ms, error, p.settings.haproxy.effective_config,
        )
        return Attempt(record)

    def _reload_failed(self, before: ProcList, confirmed: Confirmed, started: float) -> Attempt:
        p = self.parts
        error = confirmed.error or "reload failed"
        p.book.decided()
        restored = p.disk.rewrite()
        current = before.current_worker
        record = p.record("failed", started, error)
        log.error(
            "reload failed duration_ms=%d: %s; worker %s keeps serving; %s %s",
            record.duration_ms, one_line(error), current.pid if current else None,
            p.settings.haproxy.effective_config,
            "restored to the last good config" if restored else "to be restored to the last good config",
        )
        return Attempt(record, refused=confirmed.refused)
