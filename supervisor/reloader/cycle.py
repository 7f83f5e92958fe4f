"""The `Reloader`: watch the inputs, run each cycle when due, look after the master between
reloads. A cycle, master.lock held: settle, decide, `haproxy -c`, apply or reload, confirm."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from ..effective import Effective, RenderedConfigError, load_effective, off_the_loop, start_effective_check
from ..eventloop import collector_paused, on_grid, settle_after_reload, wait_set
from ..files import RuntimeDirLock, WriterBusy
from ..haproxy.answers import ProcList
from ..haproxy.api import CLIError, MasterCLI
from ..haproxy.config import Config
from ..haproxy.runtime.hook import RuntimeOutcome
from ..haproxy.server_state import clear_server_state
from ..logs import RecurringConditions
from ..master.process import MasterProcess, bind_ports, worker_ready
from ..notify import Notifier, summary_line
from ..settings import Settings
from ..state import Generation, ReloadRecord, ReloadResult, State, utcnow
from ..steering.workers import OldWorkers
from .decisions import (
    EXPECTED_IO_ERRORS,
    Attempt,
    Cause,
    Facts,
    ReloadScheduler,
    Runs,
    TransientHold,
    Verdict,
    confirm_reload,
    decide_change,
    io_error_line,
    judge_convergence,
    one_line,
    retry_delay,
    runs_goal,
)
from .records import ConfigOnDisk, GenerationBook, GenerationStore, LoadedConfig, OldWorkerCap, PendingReload
from .recovery import Recovery
from .watch import ContentCheck, content_news, inputs_digest, split_watch, watch_changes

log = logging.getLogger(__package__)

HOUSEKEEPING_S = 1.0
# At rest (no reload unconfirmed or just made, the CLI answering) housekeeping lists the
# workers this often: an old worker's exit only prunes its generation, and nothing else moves.
LISTING_AT_REST_S = 5.0
CONTENT_CHECK_S = 1.0  # the safety net under the watches: how often the rendered config is looked at
CONFIRM_POLL_S = 0.05
WRITER_POLL_S = 0.05  # how often a file being written is looked at again


RuntimeApply = Callable[[Generation, Config], Awaitable[RuntimeOutcome]]
# Just before a reload: the new worker starts with the current one's server states (maint, DOWN, weights).
SaveServerState = Callable[[Generation, Config, Path], Awaitable[bool]]


@dataclass(frozen=True)
class Unconfirmed:
    """A reload not confirmed within reload.timeout_s: it may still take (a big config loads for
    a minute), so its config stays on disk until `show proc` settles it."""

    before: ProcList
    effective: Effective
    inputs: str
    sent: float  # monotonic
    ports: set[int]  # the config's listening ports: a new worker is ready once it listens on them


async def load_whole(settings: Settings) -> Effective:
    """The effective config, read once the rendered config's writer is done (until then, not converged)."""
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


async def call_hook(hooks: OldWorkers, name: str, *args: object) -> Any:
    """The displaced-worker component's answer (prepare()'s plan goes to before_reload(), its answer
    to after_reload()); None if it raised: a component's failure must not stop a reload."""
    try:
        return await getattr(hooks, name)(*args)
    except Exception:
        log.exception("hook %s raised", name)
        return None


class Reloader:
    """watch -> debounce -> cycle -> assess, and housekeeping between cycles."""

    def __init__(
        self,
        settings: Settings,
        state: State,
        cli: MasterCLI,
        master: MasterProcess,
        hooks: OldWorkers,
        notifier: Notifier | None = None,
        runtime_apply: RuntimeApply | None = None,
        save_server_state: SaveServerState | None = None,
    ) -> None:
        self.settings, self.state, self.cli, self.master, self.hooks = settings, state, cli, master, hooks
        self.notifier = notifier or Notifier(environ={})
        self.runtime_apply = runtime_apply
        self.save_server_state = save_server_state
        reload = settings.reload
        self.scheduler = ReloadScheduler(
            reload.debounce_ms / 1000, reload.min_interval_ms / 1000, reload.max_delay_ms / 1000
        )
        self.problems = RecurringConditions(log, logging.ERROR)  # keyed by what fails, caused by the error
        self.disk = ConfigOnDisk(settings, self.problems)
        self.book = GenerationBook(state, GenerationStore(settings.haproxy.runtime_dir), self.disk, self.problems)
        self.cap = OldWorkerCap(settings.old_workers.max)
        self.recovery = Recovery(settings, master, self.book, self.disk)
        self.hold = TransientHold(reload.transient_hold_ms / 1000)
        # The safety net under the watches; its first look, taken now, is what later looks compare with.
        self.content = ContentCheck(settings.haproxy.config)
        self.content.commit(*self.content.look())
        self.runtime_lock: RuntimeDirLock | None = None  # the daemon's, renewed when runtime_dir is made again
        self.unconfirmed: Unconfirmed | None = None
        self._cycling = False  # a cycle is under way (it reads the rendered config)
        self._wake = asyncio.Event()
        self._goal: Runs | None = None  # what the node should run, from the rendered config
        # The cycle requests join, by kind ("forced", "asked"), and who asked.
        self._requested: dict[Cause, asyncio.Future[ReloadRecord | None]] = {}
        self._requested_by: list[str] = []
        self._cli_failed = False  # the master CLI failed to answer, and has not answered since
        self._listed_at = 0.0  # monotonic, housekeeping's last `show proc`; 0: list at the next round
        self._status_sent = ""

    def changed(self) -> None:
        self.scheduler.changed(time.monotonic())
        if self.state.convergence.converged:
            self.state.publish_unconverged("a change is pending", transient=True)
        self._wake.set()

    def being_written(self) -> None:
        """A watched file is being written: not converged from now, read once it is closed."""
        self.scheduler.writing = True
        if self.state.convergence.converged:
            self.state.publish_unconverged("a change is being written", transient=True)

    async def run(self) -> None:
        h = self.settings.haproxy
        files, directories = split_watch(h.config, h.watch)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(watch_changes(files, directories, [h.runtime_dir], self.changed, self.being_written))
            tg.create_task(self._schedule())
            tg.create_task(self._housekeeping())
            tg.create_task(self._content_check())

    async def _content_check(self) -> None:
        """A content no event told of (no inotify, a swap no watch could see) is a change all the same."""
        content = self.content
        while True:
            await asyncio.sleep(on_grid(CONTENT_CHECK_S))
            if self.scheduler.pending or self._cycling or content.stat_key() == content.key:  # a stat: on the loop
                continue
            key, sha = await off_the_loop(content.look)
            if self.scheduler.pending or self._cycling:
                continue  # looked at while a change came in: the next look decides
            news = content_news(sha, content.sha, self.state.rendered_sha256)
            content.commit(key, sha)
            if news:
                log.warning("watch: %s changed with no event seen; change scheduled", content.path)
                self.changed()

    async def _schedule(self) -> None:
        while True:
            due = self.scheduler.due_at()
            now = time.monotonic()
            if due is None or due > now:
                self._wake.clear()
                await wait_set(self._wake, None if due is None else due - now)
                continue
            cause = self.scheduler.take(now)
            if cause is not None:
                self._cycling = True
                try:
                    await self._cycle(cause)
                finally:
                    self._cycling = False
                    self._listed_at = 0.0  # what the cycle did is settled and capped at once

    async def _cycle(self, cause: Cause) -> None:
        waiters: list[asyncio.Future[ReloadRecord | None]] = []
        reason: str = cause
        if cause in ("forced", "asked"):
            # A forced cycle answers the requests for an asked one too: it does all they asked.
            waiters = [self._requested.pop(kind) for kind in ("asked", cause) if kind in self._requested]
            by, self._requested_by = self._requested_by, []
            reason = by[0] if len(by) == 1 else f"{by[0]} and {len(by) - 1} more requests"
        elif cause == "retry":
            convergence = self.state.convergence
            reason = f"retry {convergence.attempts}"
            log.warning("converge: attempt %d, not converged for %.1fs: %s",
                        convergence.attempts, convergence.unconverged_s(utcnow()), convergence.reason)
        attempt: Attempt | None = None
        started = time.monotonic()
        try:
            attempt = await self._attempt(force=cause == "forced", reason=reason)
        except Exception as exc:  # on I/O or a bug: logged and recorded; HAProxy serves the last good config
            if isinstance(exc, OSError) and exc.errno in EXPECTED_IO_ERRORS:
                error = io_error_line(exc)
                log.error("reload failed: %s", error)
            else:
                error = f"{type(exc).__name__}: {exc}"
                log.exception("reload failed: the cycle raised %s", type(exc).__name__)
            attempt = Attempt(self._record("failed", started, error))
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(attempt.record if attempt else None)
        self.assess(attempt)

    async def _housekeeping(self) -> None:
        """Between reloads: settle, prune, cap, restore runtime_dir, assess; and the STATUS= line."""
        while True:
            await asyncio.sleep(on_grid(HOUSEKEEPING_S))
            if self.master.up and not self.master.lock.locked():
                async with self.master.lock:
                    await self._look_after_master()
            self.assess(None)
            status = summary_line(self.state, self.book.old_count())
            if status != self._status_sent:
                self._status_sent = status
                self.notifier.status(status)

    async def _look_after_master(self) -> None:
        if not self.settings.haproxy.master_socket_path.exists():
            await self._recover_runtime_dir()
            return
        at_rest = self.unconfirmed is None and not self._cli_failed
        if at_rest and time.monotonic() - self._listed_at < LISTING_AT_REST_S:
            return
        self._listed_at = time.monotonic()
        try:
            procs = await self.cli.show_proc()
        except CLIError as exc:
            log.debug("housekeeping: %s", exc)
            self._cli_failed = True
            return
        if self._cli_failed:
            self._cli_failed = False
            if self.scheduler.answered_again(time.monotonic()):  # a pending attempt to converge runs now
                self.state.publish_next_attempt(utcnow())
                log.info("master CLI answers again: attempt %d now", self.state.convergence.attempts)
                self._wake.set()
        await self._settle(procs)
        self.book.observe(procs)
        self.cap.enforce(procs, self.state.generations)
        if self.unconfirmed is None:
            self.disk.write_back()

    async def reload_now(self, reason: str = "requested", force: bool = True) -> ReloadRecord | None:
        """Reload even when nothing changed (SIGHUP, POST /reload); with `force` False, a cycle that
        goes the way of a change (a controller's `reload`). Requests made before it starts join it."""
        kind: Cause = "forced" if force else "asked"
        future = self._requested.get(kind)
        if future is None:
            future = self._requested[kind] = asyncio.get_running_loop().create_future()
            setattr(self.scheduler, kind, True)  # .forced or .asked
            self._wake.set()
        else:
            log.info("reload requested (%s): joins the reload already due", reason)
        self._requested_by.append(reason)
        return await asyncio.shield(future)

    async def _attempt(self, force: bool, reason: str) -> Attempt | None:
        started = time.monotonic()
        if self.master.stopping:
            return None
        self._goal = None  # read afresh: until then, what the node should run is not known
        try:
            effective = await load_whole(self.settings)
        except RenderedConfigError as exc:
            # What this read found is no news for the safety net (a deleted file, bytes that are
            # not UTF-8): it would take it for a change no event told of, and count it again.
            content = self.content
            content.commit(*await off_the_loop(content.look))
            if exc.missing and not self.master.wanted:
                # A controller that has rendered nothing yet (a Ray node before Ray starts) is no
                # bad input, and nothing serves that a record would warn about: its write is the change.
                log.info("waiting for the rendered config: %s", exc)
                return None
            log.error("reload invalid: %s", exc)
            return Attempt(self._record("invalid", started, str(exc)))
        except OSError:  # the daemon short of descriptors or memory: a passing failure, retried
            raise
        except Exception as exc:  # our parser choking on input must not take the daemon down
            error = f"{self.settings.haproxy.config}: cannot build the effective config: {exc}"
            log.error("reload invalid: %s", error)
            return Attempt(self._record("invalid", started, error))
        watch = self.settings.haproxy.watch
        inputs = await off_the_loop(lambda: inputs_digest(watch))  # maps and certificates can be big
        self.state.publish_rendered(effective.rendered_sha256)
        self._goal = (effective.sha256, inputs)
        if not self.master.wanted:
            return await self._first_start(effective, inputs, started)
        current = None if force or self.state.current is None else self.state.current.model
        wait, why = self.hold.check(current, effective.effective_model, time.monotonic())
        if wait > 0:
            log.info("reload held %.1fs for the next render: %s", wait, why)
            self.scheduler.retry_at = time.monotonic() + wait
            return None
        while True:
            await self.master.wait_up()
            async with self.master.lock:
                if self.master.stopping:
                    return None
                if not self.master.up:
                    continue
                # Timed (and reload.timeout_s counted) from here, not from waiting for the lock.
                with collector_paused():
                    return await self._change(effective, inputs, force, reason, time.monotonic())

    async def _first_start(self, effective: Effective, inputs: str, started: float) -> Attempt | None:
        """No master yet: start on `effective`, else on a valid config an earlier run left on disk."""
        failed = await self.recovery.first_start(effective, inputs)
        if failed is None:
            return None
        result, error = failed
        attempt = Attempt(self._record(result, started, error))
        if await self.recovery.start_on_previous():
            return attempt
        if result == "failed":
            log.error("no effective config on disk to start haproxy with: retrying")
            return attempt
        log.error("no valid config to start haproxy with: waiting for %s to change", self.settings.haproxy.config)
        self.notifier.status(f"waiting for a valid config: {one_line(error, 200)}")
        return attempt

    async def _change(self, effective: Effective, inputs: str, force: bool, reason: str, started: float) -> Attempt:
        if self.unconfirmed is not None:
            waiting = await self._settle_first(started)
            if waiting is not None:
                return waiting
        current = self.state.current
        runs = None if current is None else (current.effective_sha256, current.inputs_sha256)
        action = decide_change(runs, (effective.sha256, inputs), force=force,
                               runtime_apply=self.runtime_apply is not None)
        if action == "skip":
            log.info("reload skipped_unchanged sha256=%s reason=%s", effective.sha256[:12], reason)
            return Attempt(self._record("skipped_unchanged", started))
        check = await start_effective_check(self.settings.haproxy, effective)
        # `haproxy -c` takes a core for a while: work out the steering meanwhile, push none before the verdict.
        plan = None
        try:
            plan = await call_hook(self.hooks, "prepare", effective)
        finally:
            ok, message = await check.verdict()  # reaps `haproxy -c` whatever happened
        if not ok:
            log.error("reload invalid: %s", one_line(message))
            record = self._record("invalid", started, message)
            self.notifier.status(summary_line(self.state))
            return Attempt(record)
        model = effective.effective_model
        if action == "runtime" and current is not None and self.runtime_apply is not None:
            try:
                outcome = await self.runtime_apply(current, model)
            except Exception:
                log.exception("runtime apply raised; reloading instead")
            else:
                if outcome.applied:
                    generation = self.book.applied_at_runtime(current, outcome.runs or model, effective, inputs,
                                                              whole=True)
                    record = self._record("runtime_applied", started)
                    log.info("reload runtime_applied generation=%d worker=%s duration_ms=%d",
                             generation.number, generation.worker_pid, record.duration_ms)
                    await call_hook(self.hooks, "refresh")
                    self.notifier.status(summary_line(self.state, self.book.old_count()))
                    return Attempt(record)
                if outcome.runs is not None:
                    # New servers went in before a refused `del server` fell back to a reload: its
                    # generation says so, for its steering once old and for a daemon restart.
                    self.book.applied_at_runtime(current, outcome.runs, effective, inputs, whole=False)
        return await self._reload(effective, model, inputs, reason, started, plan)

    async def _settle_first(self, started: float) -> Attempt | None:
        """Never a second reload while HAProxy may still load the first: settle it; an attempt if not."""
        loading = True
        try:
            procs = await self._show_proc_until(started + self.settings.reload.timeout_s)
        except CLIError as exc:
            self._cli_failed = True
            error = f"HAProxy has not settled the previous reload: {exc}"
        else:
            loading = await self._settle(procs)
            error = "HAProxy is still loading the previous reload (its new worker is not ready yet)"
        if loading:
            log.warning("reload unknown: %s", error)
            return Attempt(self._record("unknown", started, error))
        held = self.unconfirmed
        if held is not None:
            log.info("reload still unconfirmed after %.1fs, and no new worker listed: sending it again",
                     time.monotonic() - held.sent)
        return None

    async def _save_server_state(self, model: Config) -> None:
        current = self.state.current
        if self.save_server_state is None or current is None:
            return
        path = self.settings.haproxy.server_state_file
        try:
            await self.save_server_state(current, model, path)
            self.state.publish_write("server-state file", None)
        except OSError as exc:
            # A previous reload's file must not hand the new worker states that are no longer true.
            error = io_error_line(exc)
            cleared = clear_server_state(path)
            log.error("saving server state failed: %s; the new worker starts from the config", cleared or error)
            self.state.publish_write("server-state file", cleared or error)
        except Exception:  # a missing state file costs states, not the reload
            log.exception("saving server state failed; the new worker starts from the config")

    async def _reload(
        self, effective: Effective, model: Config, inputs: str, reason: str, started: float, plan: object
    ) -> Attempt:
        deadline = started + self.settings.reload.timeout_s
        try:
            before = await self._show_proc_until(deadline)
        except CLIError as exc:
            self._cli_failed = True
            log.error("reload failed: %s", exc)
            return Attempt(self._record("failed", started, str(exc)))
        plan = await call_hook(self.hooks, "before_reload", plan)
        attempt: Attempt | None = None
        try:
            await self._save_server_state(model)
            self.notifier.reloading(f"reloading: {reason}")
            if before.master is not None:
                self.book.sending_reload(PendingReload(
                    effective.sha256, effective.rendered_sha256, inputs, before.master.pid, before.master.reloads
                ))
            self.disk.write(effective)
            self.scheduler.last_reload = time.monotonic()
            try:
                # Bounded by reload.timeout_s: a stopped master accepts the connection and never answers.
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    answer = await self.cli.reload()
                if answer.success is False:
                    error = answer.log or "reload answered Success=0"
                    attempt = self._reload_failed(before, error, started, refused=True)
            except (CLIError, TimeoutError) as exc:
                # 2.6 closes the connection as the master re-executes; `show proc` decides.
                log.debug("reload command: %s", exc or "timed out")
            if attempt is None:
                attempt = await self._confirm(before, deadline, effective, model, inputs, started)
        finally:
            await call_hook(self.hooks, "after_reload", plan, attempt is not None and attempt.record.result == "ok")
        self.notifier.ready(summary_line(self.state, self.book.old_count()))
        if attempt.record.result == "ok":
            settle_after_reload()  # after the old workers are steered, never before
        return attempt

    async def _show_proc_until(self, deadline: float) -> ProcList:
        """`show proc`, given up at `deadline`: a stopped master accepts a connection and never answers."""
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                return await self.cli.show_proc()
        except TimeoutError:
            raise CLIError("show proc: no answer within reload.timeout_s") from None

    async def _verdict(self, before: ProcList, after: ProcList, ports: set[int]) -> Verdict | Literal["loading"]:
        """confirm_reload(), or "loading" while 3.1+ lists a new worker not yet loaded and bound."""
        verdict = confirm_reload(before, after)
        worker = after.current_worker
        if verdict == "ok" and worker is not None and not await worker_ready(self.cli, worker.pid, ports):
            return "loading"
        return verdict

    async def _confirm(
        self, before: ProcList, deadline: float, effective: Effective, model: Config, inputs: str, started: float
    ) -> Attempt:
        """The reload as `show proc` tells of it by `deadline`; past it, held `unconfirmed`."""
        ports = bind_ports(model)
        while True:
            if not self.master.alive:
                return self._reload_failed(before, "haproxy master exited during the reload", started)
            try:
                after = await self._show_proc_until(deadline)
                verdict = await self._verdict(before, after, ports)
            except CLIError:
                self._cli_failed = True
                verdict = "pending"
            if verdict == "ok":
                generation = self._worker_runs(effective, inputs, after)
                record = self._record("ok", started)
                log.info("reload ok generation=%d worker=%s duration_ms=%d",
                         generation.number, generation.worker_pid, record.duration_ms)
                return Attempt(record)
            if verdict == "failed":
                return self._reload_failed(before, (
                    f"HAProxy could not load the new config (show proc: failed={after.master_failed}); "
                    "its reason is in HAProxy's own log lines on the daemon's stderr"
                ), started, refused=True)
            if time.monotonic() > deadline:
                self.unconfirmed = Unconfirmed(before, effective, inputs, time.monotonic(), ports)
                error = f"no new worker in `show proc` within reload.timeout_s={self.settings.reload.timeout_s:g}s"
                record = self._record("unknown", started, error)
                log.warning("reload unknown duration_ms=%d: %s; HAProxy may still be loading it: %s keeps the "
                            "new config and `show proc` settles it",
                            record.duration_ms, error, self.settings.haproxy.effective_config)
                return Attempt(record)
            await asyncio.sleep(CONFIRM_POLL_S)

    def _reload_failed(self, before: ProcList, error: str, started: float, refused: bool = False) -> Attempt:
        restored = self.book.reload_failed()
        current = before.current_worker
        record = self._record("failed", started, error)
        log.error(
            "reload failed duration_ms=%d: %s; worker %s keeps serving; %s %s",
            record.duration_ms, one_line(error), current.pid if current else None,
            self.settings.haproxy.effective_config,
            "restored to the last good config" if restored else "to be restored to the last good config",
        )
        return Attempt(record, refused=refused)

    def _record(self, result: ReloadResult, started: float, error: str | None = None) -> ReloadRecord:
        return self.state.publish_reload(result, (time.monotonic() - started) * 1000, error)

    def _worker_runs(self, effective: Effective, inputs: str, after: ProcList) -> Generation:
        worker = after.current_worker
        assert worker is not None
        generation = self.book.reload_runs(worker.pid, effective, inputs, after)
        self.cap.enforce(after, self.state.generations)
        return generation

    def assess(self, attempt: Attempt | None) -> None:
        convergence = self.state.convergence
        current = self.state.current
        runs = None if current is None else (current.effective_sha256, current.inputs_sha256)
        judgement = judge_convergence(Facts(
            master_up=self.master.up, master_socket_ok=self.state.master_socket_ok,
            unconfirmed=self.unconfirmed is not None, change_pending=self.scheduler.pending,
            runs_goal=runs_goal(self._goal, runs), converged=convergence.converged,
            retry_set=self.scheduler.retry_at is not None, attempt=attempt,
            master_socket=str(self.settings.haproxy.master_socket_path),
        ))
        if judgement.converged:
            if not convergence.converged:
                # A write that changed nothing, or a reload that went through, says so itself.
                routine = convergence.attempts == 0 and convergence.reason == "a change is pending"
                log.log(logging.DEBUG if routine else logging.INFO,
                        "converged: worker %s runs the rendered config (sha256=%s) after %.1fs, %d retries",
                        current.worker_pid if current else None, self._goal[0][:12] if self._goal else None,
                        convergence.unconverged_s(utcnow()), convergence.attempts)
            self.state.publish_converged()
            return
        if judgement.reason is not None:
            self.state.publish_unconverged(judgement.reason, judgement.transient)
        if judgement.retry == "stop":
            self.scheduler.retry_at = None
            self.state.publish_next_attempt(None)
            if attempt is not None and attempt.record.result == "failed":
                log.warning("not converged: %s; not retried until the config changes or a reload is asked for",
                            convergence.reason)
        elif judgement.retry == "backoff":
            delay = retry_delay(convergence.attempts, self.settings.reload.retry_max_s)
            self.state.publish_next_attempt(utcnow() + timedelta(seconds=delay), convergence.attempts + 1)
            self.scheduler.retry_at = time.monotonic() + delay
            self._wake.set()
            log.warning("not converged for %.1fs: %s; attempt %d in %.1fs",
                        convergence.unconverged_s(utcnow()), convergence.reason, convergence.attempts, delay)

    async def _settle(self, procs: ProcList) -> bool:
        """Decide an unconfirmed reload from a later `show proc`; True while its new worker is not ready."""
        held = self.unconfirmed
        if held is None:
            return False
        verdict = await self._verdict(held.before, procs, held.ports)
        if verdict in ("loading", "pending"):
            return verdict == "loading"
        self.unconfirmed = None
        if verdict == "ok":
            generation = self._worker_runs(held.effective, held.inputs, procs)
            log.info("reload settled ok generation=%d worker=%s: confirmed %.1fs after it was sent",
                     generation.number, generation.worker_pid, time.monotonic() - held.sent)
            await call_hook(self.hooks, "after_reload", None, True)
            return False
        error = f"HAProxy could not load the new config (show proc: failed={procs.master_failed})"
        log.error("reload settled failed: %s", error)
        self.book.reload_failed()
        self.assess(Attempt(self._record("failed", held.sent, error), refused=True))
        return False

    async def on_master_started(self, procs: ProcList) -> Generation | None:
        """A master we started runs the effective config on disk (master.lock held, no reload yet)."""
        if procs.current_worker is None:
            return None
        # It started on the disk's config: the unconfirmed reload's, no longer held.
        held, self.unconfirmed = self.unconfirmed, None
        generation = self.recovery.master_started(
            procs, None if held is None else LoadedConfig.of(held.effective, held.inputs))
        self.cap.enforce(procs, self.state.generations)
        self._check_inputs_since_loaded("the master was starting")
        self.assess(None)
        return generation

    def rebuild(self, procs: ProcList) -> Generation | None:
        current = self.recovery.rebuild(procs)
        if current is not None:
            self.cap.enforce(procs, self.state.generations)
            self._check_inputs_since_loaded("no daemon was watching")
        return current

    def _check_inputs_since_loaded(self, why: str) -> None:
        goal = self.recovery.goal_since_loaded()
        if goal is None:
            log.info("inputs changed while %s: change scheduled", why)
            self.changed()
        else:
            self._goal = goal

    async def _recover_runtime_dir(self) -> None:
        """runtime_dir deleted under us: recreate it, then re-execute the master to rebind its socket."""
        h = self.settings.haproxy
        if self.state.master_socket_ok:
            log.error("%s is missing (runtime_dir deleted?): recreating %s, then making master pid=%s bind it again",
                      h.master_socket_path, h.runtime_dir, self.master.pid)
            self.state.publish_master_socket(False)
            self.assess(None)
        try:
            if not self.recovery.restore_runtime_dir(self.runtime_lock):
                return
        except OSError as exc:
            error = io_error_line(exc)
            self.problems.happened("runtime_dir", error, f"cannot recreate {h.runtime_dir}: {error}")
            return
        self.problems.over("runtime_dir")
        procs = await self.master.reexec(self.book.last_procs)
        if procs is None:
            return
        self.state.publish_master_socket(True)
        generation = await self.on_master_started(procs)
        log.info("runtime_dir recreated: master pid=%s answers on %s again; generation=%s worker=%s",
                 self.master.pid, h.master_socket_path, generation.number if generation else None,
                 generation.worker_pid if generation else None)
