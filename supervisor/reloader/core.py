"""The `Reloader`: holds the parts and keeps the tasks, the way gunicorn's Arbiter does. Its tasks
watch the inputs, run each cycle when it is due, and look after the master between reloads; its
handle_* methods take what a part returns, publish it, and log every change of state."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

from ..effective import RenderedConfigError, off_the_loop
from ..eventloop import collector_paused, wait_set
from ..files import RuntimeDirLock
from ..haproxy.answers import ProcList
from ..haproxy.api import CLIError, MasterCLI
from ..logs import RecurringConditions
from ..master import MasterProcess
from ..notify import Notifier, summary_line
from ..settings import Settings
from ..state import Generation, ReloadRecord, State, utcnow
from .confirm import Confirmation, Settled
from .cycle import Cycle, guarded, load_whole
from .decisions import (
    Attempt,
    Cause,
    Facts,
    ReloadScheduler,
    Runs,
    TransientHold,
    io_error_line,
    judge_convergence,
    retry_delay,
    runs_goal,
)
from .hooks import ReloadHooks, RuntimeApply, SaveServerState, call_hook
from .parts import Parts
from .records import ConfigOnDisk, GenerationBook, GenerationStore, OldWorkerCap
from .recovery import Recovery
from .watch import ContentCheck, content_news, inputs_digest, split_watch, watch_changes

log = logging.getLogger(__package__)

HOUSEKEEPING_S = 1.0
CONTENT_CHECK_S = 1.0  # the safety net under the watches: how often the rendered config is looked at


class Reloader:
    """watch -> debounce -> cycle -> assess, and housekeeping between cycles (see the package's docstring)."""

    def __init__(
        self,
        settings: Settings,
        state: State,
        cli: MasterCLI,
        master: MasterProcess,
        hooks: ReloadHooks,
        notifier: Notifier | None = None,
        runtime_apply: RuntimeApply | None = None,
        save_server_state: SaveServerState | None = None,
    ) -> None:
        self.settings, self.state, self.cli, self.master = settings, state, cli, master
        reload = settings.reload
        self.scheduler = ReloadScheduler(
            reload.debounce_ms / 1000, reload.min_interval_ms / 1000, reload.max_delay_ms / 1000
        )
        self.problems = RecurringConditions(log, logging.ERROR)  # keyed by what fails, caused by the error
        store = GenerationStore(settings.haproxy.runtime_dir)
        self.parts = Parts(
            settings, state, cli, master, notifier or Notifier(environ={}), hooks, self.scheduler,
            GenerationBook(state, store, self.problems), ConfigOnDisk(settings, self.problems),
            Confirmation(cli, master, reload.timeout_s, self.cli_failed), OldWorkerCap(settings.old_workers.max),
        )
        self.cycle = Cycle(self.parts, runtime_apply, save_server_state, self.handle_settled, self.cli_failed)
        self.recovery = Recovery(self.parts)
        self.hold = TransientHold(reload.transient_hold_ms / 1000)
        self.watch_files, self.watch_dirs = split_watch(settings.haproxy.config, settings.haproxy.watch)
        self.watch_ignore = [settings.haproxy.runtime_dir]
        # The safety net under the watches; its first look, taken now, is what later looks compare with.
        self.content = ContentCheck(settings.haproxy.config)
        self.content.commit(*self.content.look())
        self.runtime_lock: RuntimeDirLock | None = None  # the daemon's, renewed when runtime_dir is made again
        self._cycling = False  # a cycle is under way (it reads the rendered config)
        self._wake = asyncio.Event()
        # What the node should run: (effective sha256, watched files' digest) of the rendered config.
        self._goal: Runs | None = None
        # The cycle requests join, by kind ("forced", "asked"), and who asked.
        self._requested: dict[Cause, asyncio.Future[ReloadRecord | None]] = {}
        self._requested_by: list[str] = []
        self._cli_failed = False  # the master CLI failed to answer, and has not answered since
        self._status_sent = ""
        state.publish_paths(str(settings.haproxy.config), str(settings.haproxy.effective_config))

    # ------------------------------------------------------------ events

    def changed(self, now: float | None = None) -> None:
        self.scheduler.changed(time.monotonic() if now is None else now)
        if self.state.convergence.converged:
            self.state.publish_unconverged("a change is pending", transient=True)
        self._wake.set()

    def being_written(self) -> None:
        """A watched file is being written: not converged from now, read once it is closed."""
        self.scheduler.being_written()
        if self.state.convergence.converged:
            self.state.publish_unconverged("a change is being written", transient=True)

    def cli_failed(self) -> None:
        self._cli_failed = True

    def cli_answered(self) -> None:
        """The master CLI answered: after a failure, a pending attempt to converge runs now."""
        if not self._cli_failed:
            return
        self._cli_failed = False
        if self.scheduler.answered_again(time.monotonic()):
            self.state.publish_next_attempt(utcnow())
            log.info("master CLI answers again: attempt %d now", self.state.convergence.attempts)
            self._wake.set()

    # ------------------------------------------------------------ tasks

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(watch_changes(self.watch_files, self.watch_dirs, self.watch_ignore, self.changed,
                                         self.being_written))
            tg.create_task(self._schedule())
            tg.create_task(self._housekeeping())
            tg.create_task(self._content_check())

    async def _content_check(self) -> None:
        """Every CONTENT_CHECK_S: a stat of the rendered config through its symlinks, and a hash
        when the stat changed. A content no event told of (a path component swapped where no
        watch could see it, a filesystem without inotify) is a change all the same. While a
        change is pending or a cycle runs, it waits: that cycle reads the file anyway."""
        content = self.content
        while True:
            await asyncio.sleep(CONTENT_CHECK_S)
            if self.scheduler.pending or self._cycling or not content.stale():
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

    async def _cycle(self, cause: Cause) -> ReloadRecord | None:
        """One cycle toward the goal; then convergence is assessed and a retry set when needed."""
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
        try:
            attempt = await guarded(self.parts, self._attempt(force=cause == "forced", reason=reason))
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(attempt.record if attempt else None)
        self.assess(attempt)
        return attempt.record if attempt else None

    async def _housekeeping(self) -> None:
        """Between reloads: settle an unconfirmed reload, prune generations whose worker is gone,
        enforce old_workers.max, put back what was lost from runtime_dir, assess convergence."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            if self.master.up and not self.master.lock.locked():
                async with self.master.lock:
                    await self._look_after_master()
            self.assess(None)
            status = summary_line(self.state, self.parts.book.old_count())
            if status != self._status_sent:
                self._status_sent = status
                self.parts.notifier.status(status)

    async def _look_after_master(self) -> None:
        """One housekeeping round, with master.lock held (taken at once: the master is up)."""
        if not self.settings.haproxy.master_socket_path.exists():
            await self._recover_runtime_dir()
            return
        try:
            procs = await self.cli.show_proc()
        except CLIError as exc:
            log.debug("housekeeping: %s", exc)
            self.cli_failed()
            return
        self.cli_answered()
        settled = await self.parts.confirmation.settle(procs)
        if settled is not None:
            await self.handle_settled(settled, procs)
        self.parts.observe(procs)
        if self.parts.confirmation.unconfirmed is None:
            self.parts.disk.write_back()

    # ------------------------------------------------------------ requests

    async def reload_now(self, reason: str = "requested", force: bool = True) -> ReloadRecord | None:
        """Reload even when nothing changed (SIGHUP, POST /reload), as soon as reload.min_interval_ms
        allows; with `force` False, a cycle that goes the way of a change: skipped when nothing
        changed, applied at runtime when it can be (a controller's `reload`). Requests made
        before that cycle starts join it and get its record."""
        kind: Cause = "forced" if force else "asked"
        future = self._requested.get(kind)
        if future is None:
            future = self._requested[kind] = asyncio.get_running_loop().create_future()
            if force:
                self.scheduler.force()
            else:
                self.scheduler.ask()
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
            return Attempt(self.parts.record("invalid", started, str(exc)))
        except OSError:  # the daemon short of descriptors or memory: a passing failure, retried
            raise
        except Exception as exc:  # our parser choking on input must not take the daemon down
            error = f"{self.settings.haproxy.config}: cannot build the effective config: {exc}"
            log.error("reload invalid: %s", error)
            return Attempt(self.parts.record("invalid", started, error))
        watch = self.settings.haproxy.watch
        inputs = await off_the_loop(lambda: inputs_digest(watch))  # maps and certificates can be big
        self.state.publish_rendered(effective.rendered_sha256)
        self._goal = (effective.sha256, inputs)
        if not self.master.wanted:
            return await self.recovery.first_start(effective, inputs, started)
        current = None if force or self.state.current is None else self.state.current.model
        wait, why = self.hold.check(current, effective.effective_model, effective.sha256, time.monotonic())
        if wait > 0:
            log.info("reload held %.1fs for the next render: %s", wait, why)
            self.scheduler.retry(time.monotonic() + wait)
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
                    return await self.cycle.change(effective, inputs, force, reason, time.monotonic())

    # ------------------------------------------------------------ handlers

    def assess(self, attempt: Attempt | None) -> None:
        """Judge whether the current worker runs the goal (decisions.judge_convergence), publish
        the judgement, and schedule the next attempt it asks for."""
        convergence = self.state.convergence
        current = self.state.current
        runs = None if current is None else (current.effective_sha256, current.inputs_sha256)
        judgement = judge_convergence(Facts(
            master_up=self.master.up, master_socket_ok=self.state.master_socket_ok,
            unconfirmed=self.parts.confirmation.unconfirmed is not None, change_pending=self.scheduler.pending,
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
            self.scheduler.retry(None)
            self.state.publish_next_attempt(None)
            if attempt is not None and attempt.record.result == "failed":
                log.warning("not converged: %s; not retried until the config changes or a reload is asked for",
                            convergence.reason)
        elif judgement.retry == "backoff":
            delay = retry_delay(convergence.attempts, self.settings.reload.retry_max_s)
            self.state.publish_next_attempt(utcnow() + timedelta(seconds=delay), convergence.attempts + 1)
            self.scheduler.retry(time.monotonic() + delay)
            self._wake.set()
            log.warning("not converged for %.1fs: %s; attempt %d in %.1fs",
                        convergence.unconverged_s(utcnow()), convergence.reason, convergence.attempts, delay)

    async def handle_settled(self, settled: Settled, procs: ProcList) -> None:
        """A reload HAProxy did not confirm in time is decided by a later `show proc`."""
        held = settled.of
        if held is None:
            return
        waited = time.monotonic() - held.sent
        if settled.verdict == "ok":
            generation = self.parts.loaded_by(held.effective, held.inputs, procs)
            log.info("reload settled ok generation=%d worker=%s: confirmed %.1fs after it was sent",
                     generation.number, generation.worker_pid, waited)
            await call_hook(self.parts.hooks, "after_reload", None, True)
            return
        error = f"HAProxy could not load the new config (show proc: failed={procs.master_failed})"
        log.error("reload settled failed: %s", error)
        self.parts.book.decided()
        self.parts.disk.rewrite()
        self.assess(Attempt(self.parts.record("failed", held.sent, error), refused=True))

    async def on_master_started(self, procs: ProcList) -> Generation | None:
        """A master we started (first start or restart) runs the effective config on disk. Called
        by MasterProcess.run() with master.lock held, before any reload can run."""
        generation = self.recovery.master_started(procs)
        if generation is None:
            return None
        self._check_inputs_since_loaded("the master was starting")
        self.assess(None)
        return generation

    async def take_back(self, pid: int) -> ProcList | None:
        return await self.recovery.take_back(pid)

    def rebuild(self, procs: ProcList) -> Generation | None:
        """After adoption: the generations every live worker runs, from what an earlier daemon recorded."""
        current = self.recovery.rebuild(procs)
        if current is not None:
            self._check_inputs_since_loaded("no daemon was watching")
        return current

    def _check_inputs_since_loaded(self, why: str) -> None:
        """Schedule a change when the rendered config or a watched file differs from what was loaded."""
        goal = self.recovery.goal_since_loaded()
        if goal is None:
            log.info("inputs changed while %s: change scheduled", why)
            self.changed()
        else:
            self._goal = goal

    async def _recover_runtime_dir(self) -> None:
        """The master's socket is gone (runtime_dir deleted under us): recreate what the daemon
        owns, then make the master re-execute, which binds its socket again, with master.lock held."""
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
        procs = await self.master.reexec(self.parts.book.last_procs)
        if procs is None:
            return
        self.state.publish_master_socket(True)
        generation = await self.on_master_started(procs)
        log.info("runtime_dir recreated: master pid=%s answers on %s again; generation=%s worker=%s",
                 self.master.pid, h.master_socket_path, generation.number if generation else None,
                 generation.worker_pid if generation else None)
