"""The `Reloader`: one object that owns the reload cycle. Its tasks watch the inputs, run each
cycle when it is due, and look after the master between reloads; its requests force a reload."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

from ..effective import off_the_loop
from ..haproxy.api import CLIError
from ..notify import summary_line
from ..state import ReloadRecord, utcnow
from ..waiting import wait_set
from .cycle import ReloadCycle
from .problems import EXPECTED_IO_ERRORS, io_error_line
from .recovery import Recovery
from .schedule import Cause
from .watch import content_news, watch_changes

log = logging.getLogger(__package__)

HOUSEKEEPING_S = 1.0
CONTENT_CHECK_S = 1.0  # the safety net under the watches: how often the rendered config is looked at


class Reloader(ReloadCycle, Recovery):
    """watch -> debounce -> cycle -> assess, and housekeeping between cycles (see the package's docstring)."""

    # ------------------------------------------------------------ tasks

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch())
            tg.create_task(self._schedule())
            tg.create_task(self._housekeeping())
            tg.create_task(self._content_check())

    async def _watch(self) -> None:
        await watch_changes(self.watch_files, self.watch_dirs, self.watch_ignore, self.changed, self.being_written)

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
        record: ReloadRecord | None = None
        self._refused = False
        try:
            record = await self._guarded(self.apply_change(force=cause == "forced", reason=reason))
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(record)
        self._assess(record)
        return record

    async def _housekeeping(self) -> None:
        """Between reloads: settle an unconfirmed reload, prune generations whose worker is gone,
        enforce old_workers.max, put back what was lost from runtime_dir, assess convergence."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            if self.master.up and not self.master.lock.locked():
                async with self.master.lock:
                    await self._look_after_master()
            self._assess(None)
            status = summary_line(self.state, self._old_count())
            if status != self._status_sent:
                self._status_sent = status
                self.notifier.status(status)

    async def _look_after_master(self) -> None:
        """One housekeeping round, with master.lock held."""
        if not self.master.up:
            return
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
        await self._settle(procs)
        self._observe(procs)
        if self._unconfirmed is None:
            self._write_back()

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

    async def _guarded(self, cycle: Awaitable[ReloadRecord | None]) -> ReloadRecord | None:
        """One cycle failing on I/O (disk full, permissions) or a bug is logged and recorded; the
        daemon goes on watching, HAProxy goes on serving the last good config."""
        started = time.monotonic()
        try:
            return await cycle
        except OSError as exc:
            if exc.errno not in EXPECTED_IO_ERRORS:
                log.exception("reload failed: the cycle raised %s", type(exc).__name__)
                return self._record("failed", started, f"{type(exc).__name__}: {exc}")
            error = io_error_line(exc)
            log.error("reload failed: %s", error)
            return self._record("failed", started, error)
        except Exception as exc:
            log.exception("reload failed: the cycle raised %s", type(exc).__name__)
            return self._record("failed", started, f"{type(exc).__name__}: {exc}")
