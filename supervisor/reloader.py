"""Watch the rendered config, and turn each burst of changes into one safe reload.

watch -> debounce -> render -> skip if unchanged -> `haproxy -c` -> runtime apply or
(write effective, `reload` on the master CLI, confirm with `show proc`) -> new generation.

The decisions (when to reload, whether a reload took, which old workers exceed the
limit, which paths are relevant) are pure and unit-tested; this module's I/O is a
thin shell around them, tested end to end with the real binary.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Literal, Protocol

import psutil
from watchfiles import Change, awatch

from .effective import (
    Effective,
    RenderedConfigError,
    load_effective,
    off_the_loop,
    prepare_runtime_dir,
    read_rendered,
    remove_stale_slot_tables,
    sha256_text,
    start_effective_check,
    validate,
    write_atomically,
    write_effective,
    write_slot_table,
)
from .files import read_regular
from .gcpolicy import collector_paused, settle_after_reload
from .generations import (
    GenerationStore,
    PendingReload,
    Snapshot,
    loaded_pending,
    plan_rebuild,
    prunable,
    record_of,
)
from .haproxy.api import CLIError, MasterCLI, Proc, ProcList
from .haproxy.config import Config
from .haproxy.inject import SLOT_TABLE_PREFIX, SlotTable
from .master import MasterError, MasterProcess, bind_ports, process_started_at, worker_ready
from .notify import Notifier, summary_line
from .settings import Settings
from .state import Generation, ReloadRecord, ReloadResult, State, utcnow

log = logging.getLogger(__name__)
# watchfiles logs every batch at INFO; our own lines say what a change led to.
logging.getLogger("watchfiles").setLevel(logging.WARNING)

HOUSEKEEPING_S = 1.0
CONFIRM_POLL_S = 0.05

# ---------------------------------------------------------------- hooks


class ReloadHooks(Protocol):
    """What the displaced-worker component needs around each change."""

    async def prepare(self, next_model: Config) -> None: ...

    async def before_reload(self, next_model: Config) -> None: ...

    async def after_reload(self, ok: bool) -> None: ...

    async def refresh(self) -> None: ...


class NoHooks:
    async def prepare(self, next_model: Config) -> None:
        return None

    async def before_reload(self, next_model: Config) -> None:
        return None

    async def after_reload(self, ok: bool) -> None:
        return None

    async def refresh(self) -> None:
        return None


# (current generation, new effective model, the effective config) -> True when applied without a reload.
RuntimeApply = Callable[[Generation, Config, Effective], Awaitable[bool]]
# (current generation, next effective model, state file) -> saved. Runs just before a reload so
# the new worker starts with the current worker's server states (maint, DOWN, weights).
SaveServerState = Callable[[Generation, Config, Path], Awaitable[bool]]


# ---------------------------------------------------------------- pure decisions


Cause = Literal["forced", "change", "retry"]


@dataclass
class ReloadScheduler:
    """When the next cycle is due, and why.

    A change is due `debounce_s` after the last write of a burst; a forced reload (SIGHUP,
    POST /reload) at once; a retry (the node has not converged) at the time it was set for.
    None of them before `min_interval_s` after the previous reload. Whatever is pending when
    one is due coalesces into it: the cycle reads every file afresh. Fed with monotonic
    timestamps, so it is tested without clocks or files.
    """

    debounce_s: float
    min_interval_s: float
    last_change: float | None = None  # newest change not yet handled
    last_reload: float | None = None  # when the previous reload was issued
    forced: bool = False  # a forced reload is asked for
    retry_at: float | None = None  # when to try again to converge

    def changed(self, now: float) -> None:
        self.last_change = now

    def force(self) -> None:
        self.forced = True

    def retry(self, at: float | None) -> None:
        self.retry_at = at

    @property
    def pending(self) -> bool:
        return self.forced or self.last_change is not None or self.retry_at is not None

    def _cause_and_time(self) -> tuple[Cause, float] | None:
        if self.forced:
            return "forced", float("-inf")
        if self.last_change is not None:
            # A retry never reads a file that is still being written: the change's debounce wins.
            return "change", self.last_change + self.debounce_s
        if self.retry_at is not None:
            return "retry", self.retry_at
        return None

    def due_at(self) -> float | None:
        due = self._cause_and_time()
        return None if due is None else max(due[1], self.earliest_reload())

    def earliest_reload(self) -> float:
        return float("-inf") if self.last_reload is None else self.last_reload + self.min_interval_s

    def take(self, now: float) -> Cause | None:
        """What is due at `now` (and everything pending consumed), or None."""
        due = self._cause_and_time()
        if due is None or now < max(due[1], self.earliest_reload()):
            return None
        self.clear()
        return due[0]

    def clear(self) -> None:
        self.last_change = None
        self.forced = False
        self.retry_at = None

    def reloaded(self, now: float) -> None:
        self.last_reload = now


RETRY_FIRST_S = 0.5


def retry_delay(attempts: int, max_s: float) -> float:
    """0.5 s before the first retry, then twice as long each time, up to `max_s`."""
    return min(max_s, RETRY_FIRST_S * 2 ** min(attempts, 32))


def runs_goal(goal: tuple[str, str | None] | None, current: tuple[str, str | None] | None) -> bool:
    """Does the current worker run the goal? Both are (effective sha256, watched files' digest)."""
    return goal is not None and current is not None and goal == current


Verdict = Literal["ok", "failed", "pending", "unknown"]


def confirm_reload(before: ProcList, after: ProcList) -> Verdict:
    """Did the reload take? Decided from two `show proc` answers.

    ok: a current worker that was not there before. failed: the master's `[failed: N]`
    grew, or the master reloaded (its counter moved) with failures and no new worker.
    HAProxy resets `failed` to 0 on a successful load, so "unchanged" is not required.
    """
    if after.master is None:
        return "pending"
    known = {p.pid for p in (*before.workers, *before.old_workers)}
    current = after.current_worker
    if current is not None and current.pid not in known:
        return "ok"
    if after.master_failed > before.master_failed:
        return "failed"
    if (
        before.master is not None
        and after.master.reloads > before.master.reloads
        and after.master_failed > 0
    ):
        return "failed"
    return "pending"


def old_workers_over_max(procs: ProcList, max_old: int) -> list[Proc]:
    """The old workers beyond `max_old`, oldest first (the most reloads ago, then lowest PID)."""
    olds = sorted(procs.old_workers, key=lambda p: (-p.reloads, p.pid))
    excess = len(olds) - max_old
    return olds[:excess] if excess > 0 else []


def _is_k8s_internal(relative: Path) -> bool:
    # Kubernetes' atomic writer keeps the real files in `..<timestamp>/` and swaps `..data`.
    return bool(relative.parts) and relative.parts[0].startswith("..")


class ChangeFilter:
    """Which filesystem events mean "the input changed".

    Watched files are seen through their parent directory, so a rename into place
    (editors, `mv`), a ConfigMap's `..data` symlink swap and a write through the file
    all count, while an editor's swap files and our own runtime_dir do not.
    """

    def __init__(self, files: Iterable[Path], directories: Iterable[Path], ignore: Iterable[Path] = ()) -> None:
        self.files = [Path(f) for f in files]
        self.targets = {f.resolve() for f in self.files} - set(self.files)
        self.directories = [Path(d) for d in directories]
        self.ignore = [Path(i) for i in ignore]

    def __call__(self, change: Change, path: str) -> bool:
        return self.relevant(Path(path))

    def relevant(self, p: Path) -> bool:
        if any(p == i or i in p.parents for i in self.ignore):
            return False
        for f in self.files:
            if p == f:
                return True
            if f.parent in p.parents and _is_k8s_internal(p.relative_to(f.parent)):
                return True
        if p in self.targets:
            return True
        return any(p == d or d in p.parents for d in self.directories)


def split_watch(config: Path, watch: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(files, directories) among what to watch; a path that does not exist yet counts as a file."""
    files = [config]
    dirs: list[Path] = []
    for p in watch:
        (dirs if p.is_dir() else files).append(p)
    return files, dirs


def watch_roots(files: Sequence[Path], directories: Sequence[Path]) -> list[Path]:
    """Directories to hand to inotify: each file's parent (and its symlink target's), each directory."""
    roots: set[Path] = set(directories)
    for f in files:
        roots.add(f.parent)
        target = f.resolve().parent
        if target != f.parent:
            roots.add(target)
    ordered = sorted(roots, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for root in ordered:
        if not any(k == root or k in root.parents for k in kept):
            kept.append(root)
    return kept


def inputs_digest(paths: Sequence[Path]) -> str:
    """sha256 over the content of every file under haproxy.watch: maps, certificates, includes.

    A change there needs a reload even when the effective config text is the same.
    Kubernetes' `..` internals are skipped: the visible names resolve through them.
    """
    h = hashlib.sha256()
    for root in sorted(paths):
        if root.is_dir():
            entries = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".."))
                entries.extend(Path(dirpath) / n for n in filenames if not n.startswith(".."))
            items = sorted(entries)
        else:
            items = [root]
        for item in items:
            h.update(str(item).encode() + b"\0")
            try:
                # A FIFO dropped into a watched directory must not block the loop: regular files only.
                h.update(hashlib.sha256(read_regular(item)).digest())
            except OSError:
                h.update(b"missing")
    return h.hexdigest()


def one_line(text: str, limit: int = 400) -> str:
    """HAProxy's message on one log line: its ALERT lines first, joined with ` | `."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    alerts = [ln for ln in lines if "ALERT" in ln] or lines
    joined = " | ".join(alerts)
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


# ---------------------------------------------------------------- the reloader


@dataclass
class LoadedConfig:
    """The effective config on disk that the current worker runs (the last good one)."""

    text: str
    rendered_sha256: str
    inputs_sha256: str | None
    slot_table: SlotTable | None = None  # the file the config names, rewritten with it after a loss

    @cached_property
    def sha256(self) -> str:
        # Compared every housekeeping round: a 50 MB config is hashed once, not every second.
        return sha256_text(self.text)

    @classmethod
    def of(cls, effective: Effective, inputs: str | None) -> LoadedConfig:
        return cls(effective.text, effective.rendered_sha256, inputs, effective.slot_table)


@dataclass
class Unconfirmed:
    """A reload HAProxy did not confirm within reload.timeout_s: it may still take (a big
    config loads for a minute), so the new config stays on disk until `show proc` settles it."""

    before: ProcList
    effective: Effective
    inputs: str
    sent: float  # monotonic
    ports: set[int]  # the config's listening ports: a new worker is ready once it listens on them


# Errors of the disk, not of the daemon: one log line each, no traceback.
EXPECTED_IO_ERRORS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO,
    errno.EMFILE, errno.ENFILE,
})


def io_error_line(exc: OSError) -> str:
    """`<file>: <strerror>`, the way the shell says it."""
    what = exc.strerror or str(exc)
    return f"{exc.filename}: {what}" if exc.filename else what


class ProblemLog:
    """One log line when a condition starts, or changes, and one when it is over; not one per try."""

    def __init__(self) -> None:
        self.active: dict[str, str] = {}

    def report(self, key: str, exc: OSError, message: str) -> None:
        """`message` at error level, unless `key` already failed with the same error."""
        condition = io_error_line(exc)
        if self.active.get(key) == condition:
            log.debug("%s", message)
            return
        self.active[key] = condition
        log.error("%s", message)

    def clear(self, key: str) -> None:
        if self.active.pop(key, None) is not None:
            log.info("%s: works again", key)


class Reloader:
    def __init__(
        self,
        settings: Settings,
        state: State,
        cli: MasterCLI,
        master: MasterProcess,
        notifier: Notifier | None = None,
        hooks: ReloadHooks | None = None,
        runtime_apply: RuntimeApply | None = None,
        save_server_state: SaveServerState | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.cli = cli
        self.master = master
        self.notifier = notifier or Notifier(environ={})
        self.hooks: ReloadHooks = hooks or NoHooks()
        self.runtime_apply = runtime_apply
        self.save_server_state = save_server_state
        self.store = GenerationStore(settings.haproxy.runtime_dir)
        self.scheduler = ReloadScheduler(settings.reload.debounce_ms / 1000, settings.reload.min_interval_ms / 1000)
        files, dirs = split_watch(settings.haproxy.config, settings.haproxy.watch)
        self.watch_files, self.watch_dirs = files, dirs
        self.filter = ChangeFilter(files, dirs, ignore=[settings.haproxy.runtime_dir])
        self._wake = asyncio.Event()
        self._inputs: dict[int, str | None] = {}  # generation -> inputs digest it was loaded with
        self._last_number = 0
        self.loaded: LoadedConfig | None = None
        self.last_procs: ProcList | None = None
        self._persisted: Snapshot | None = None
        self._terminated: set[int] = set()  # old workers we sent SIGTERM, until they are gone
        self._status_sent = ""
        # What the node should run: (effective sha256, watched files' digest) of the rendered config.
        self._goal: tuple[str, str | None] | None = None
        self._unconfirmed: Unconfirmed | None = None
        self._pending: PendingReload | None = None  # the reload sent and not yet decided, as recorded
        self._forced: asyncio.Future[ReloadRecord | None] | None = None  # the forced reload requests join
        self._forced_by: list[str] = []
        self._on_disk_sha: str | None = None  # the effective config last written to disk
        self._refused = False  # the last reload failed because HAProxy could not load the config
        self.problems = ProblemLog()
        state.rendered_path = str(settings.haproxy.config)
        state.effective_path = str(settings.haproxy.effective_config)

    # ------------------------------------------------------------ tasks

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch())
            tg.create_task(self._schedule())
            tg.create_task(self._housekeeping())

    def changed(self, now: float | None = None) -> None:
        self.scheduler.changed(time.monotonic() if now is None else now)
        if self.state.convergence.converged:
            self.state.convergence.missed("a change is pending", transient=True)
        self._wake.set()

    async def _watch(self) -> None:
        roots = watch_roots(self.watch_files, self.watch_dirs)
        reported: list[Path] = []
        while True:
            existing = [r for r in roots if r.is_dir()]
            missing = [r for r in roots if not r.is_dir()]
            if missing != reported:
                if missing:
                    log.warning("watch: %s missing; watching for it to appear", ", ".join(map(str, missing)))
                elif reported:
                    # What appeared may hold the rendered config: look at it.
                    self.changed()
                reported = missing
            if not existing:
                await asyncio.sleep(1)
                continue
            log.info("watching %s", ", ".join(map(str, existing)))
            # watchfiles' own batching is kept short: the debounce that matters is ours. With a root
            # missing, wake up every second to see whether it appeared.
            async for changes in awatch(
                *existing, watch_filter=self.filter, debounce=50, step=10,
                rust_timeout=1000 if missing else None, yield_on_timeout=bool(missing),
            ):
                if changes:
                    log.debug("change: %s", ", ".join(sorted(p for _, p in changes)))
                    self.changed()
                if missing and any(r.is_dir() for r in missing):
                    break

    async def _schedule(self) -> None:
        while True:
            due = self.scheduler.due_at()
            now = time.monotonic()
            if due is None or due > now:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), None if due is None else due - now)
                continue
            cause = self.scheduler.take(now)
            if cause is not None:
                await self._cycle(cause)

    async def _cycle(self, cause: Cause) -> ReloadRecord | None:
        """One cycle toward the goal; then convergence is assessed and a retry set when needed."""
        waiters: asyncio.Future[ReloadRecord | None] | None = None
        reason: str = cause
        if cause == "forced":
            waiters, self._forced = self._forced, None
            by, self._forced_by = self._forced_by, []
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
            if waiters is not None and not waiters.done():
                waiters.set_result(record)
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
            return
        await self._settle(procs)
        self._observe(procs)
        if self._unconfirmed is None:
            self._write_back()

    def _write_back(self) -> None:
        """The effective config on disk is what a restarted master loads: keep it what runs."""
        loaded = self.loaded
        if loaded is None or loaded.sha256 == self._on_disk_sha:
            return
        try:
            write_slot_table(loaded.slot_table)
            self._write_effective_text(loaded.text)
        except OSError as exc:
            self.problems.report("effective config", exc, f"cannot write back the running config: {io_error_line(exc)}")
            return
        self.problems.clear("effective config")

    def _write_effective_text(self, text: str) -> None:
        write_atomically(self.settings.haproxy.effective_config, text)
        self._on_disk_sha = sha256_text(text)

    # ------------------------------------------------------------ requests

    async def reload_now(self, reason: str = "requested") -> ReloadRecord | None:
        """Reload even when nothing changed (SIGHUP, POST /reload), as soon as reload.min_interval_ms
        allows. Requests made before that reload starts join it and get its record."""
        if self._forced is None:
            self._forced = asyncio.get_running_loop().create_future()
            self.scheduler.force()
            self._wake.set()
        else:
            log.info("reload requested (%s): joins the reload already due", reason)
        self._forced_by.append(reason)
        return await asyncio.shield(self._forced)

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

    # ------------------------------------------------------------ the cycle

    def _record(self, result: ReloadResult, started: float, error: str | None = None) -> ReloadRecord:
        return self.state.reloads.record(result, (time.monotonic() - started) * 1000, error)

    async def apply_change(self, force: bool, reason: str) -> ReloadRecord | None:
        started = time.monotonic()
        if self.master.stopping:
            return None
        self._goal = None  # read afresh: until then, what the node should run is not known
        try:
            with collector_paused():  # gcpolicy: no collection on the way to steering
                settings = self.settings
                effective = await off_the_loop(lambda: load_effective(settings))
        except RenderedConfigError as exc:
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

    async def _change_locked(
        self, effective: Effective, inputs: str, force: bool, reason: str, started: float
    ) -> ReloadRecord:
        if self._unconfirmed is not None:
            # Settle the previous reload first: a second one must not be sent while HAProxy may
            # still be loading the first.
            try:
                loading = await self._settle(await self._show_proc_until(started + self.settings.reload.timeout_s))
            except CLIError as exc:
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

    async def _show_proc_until(self, deadline: float) -> ProcList:
        """`show proc`, given up at `deadline`: a stopped master accepts a connection and never answers."""
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                return await self.cli.show_proc()
        except TimeoutError:
            raise CLIError("show proc: no answer within reload.timeout_s") from None

    async def _confirm(
        self, before: ProcList, deadline: float, ports: set[int]
    ) -> tuple[Verdict, ProcList | None, str | None]:
        after: ProcList | None = None
        while True:
            if not self.master.alive:
                return "failed", after, "haproxy master exited during the reload"
            try:
                after = await self._show_proc_until(deadline)
                verdict = confirm_reload(before, after)
                worker = after.current_worker
                if verdict == "ok" and worker is not None and not await worker_ready(self.cli, worker.pid, ports):
                    verdict = "pending"  # 3.1+ lists the new worker before it has loaded and bound
            except CLIError:
                verdict = "pending"
            if verdict == "ok":
                return "ok", after, None
            if verdict == "failed":
                assert after is not None
                self._refused = True
                return "failed", after, (
                    f"HAProxy could not load the new config (show proc: failed={after.master_failed}); "
                    "its reason is in HAProxy's own log lines on the daemon's stderr"
                )
            if time.monotonic() > deadline:
                return "unknown", after, (
                    f"no new worker in `show proc` within reload.timeout_s={self.settings.reload.timeout_s:g}s"
                )
            await asyncio.sleep(CONFIRM_POLL_S)

    def _reload_ok(self, effective: Effective, inputs: str, after: ProcList, started: float) -> ReloadRecord:
        generation = self._loaded_by(effective, inputs, after)
        record = self._record("ok", started)
        log.info(
            "reload ok generation=%d worker=%s duration_ms=%d",
            generation.number, generation.worker_pid, record.duration_ms,
        )
        return record

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
            self.problems.report("generation configs", exc, (
                f"cannot record generation {number}'s config: {io_error_line(exc)} "
                "(HAProxy runs it; a daemon restarted now would not know its text)"
            ))
            return
        self.problems.clear("generation configs")

    def _reload_unknown(
        self, before: ProcList, effective: Effective, inputs: str, error: str, started: float, model: Config
    ) -> ReloadRecord:
        self._unconfirmed = Unconfirmed(before, effective, inputs, time.monotonic(), bind_ports(model))
        record = self._record("unknown", started, error)
        log.warning(
            "reload unknown duration_ms=%d: %s; HAProxy may still be loading it: %s keeps the new config "
            "and `show proc` settles it",
            record.duration_ms, error, self.settings.haproxy.effective_config,
        )
        return record

    async def _settle(self, procs: ProcList) -> bool:
        """Decide an unconfirmed reload from a later `show proc` (with master.lock held). True
        while HAProxy is still loading it: a new worker is listed but not ready yet (3.1+ lists
        it before it has loaded its config), so nothing else may be sent meanwhile."""
        pending = self._unconfirmed
        if pending is None:
            return False
        verdict = confirm_reload(pending.before, procs)
        worker = procs.current_worker
        if verdict == "ok" and worker is not None and not await worker_ready(self.cli, worker.pid, pending.ports):
            return True
        if verdict == "pending":
            return False
        self._unconfirmed = None
        waited = time.monotonic() - pending.sent
        if verdict == "ok":
            generation = self._loaded_by(pending.effective, pending.inputs, procs)
            log.info("reload settled ok generation=%d worker=%s: confirmed %.1fs after it was sent",
                     generation.number, generation.worker_pid, waited)
            await self._call_hook("after_reload", True)
        else:
            error = f"HAProxy could not load the new config (show proc: failed={procs.master_failed})"
            log.error("reload settled failed: %s", error)
            self._restore_loaded()
            self._refused = True
            self._assess(self._record("failed", pending.sent, error))
        return False

    def _remove_stale_slot_tables(self, running: Effective) -> None:
        try:
            removed = remove_stale_slot_tables(self.settings.haproxy.runtime_dir, running.slot_table)
        except OSError as exc:  # a leftover file costs disk space, not the reload
            log.warning("cannot remove old slot tables: %s", exc.strerror or exc)
            return
        if removed:
            log.debug("slot tables removed: %s", ", ".join(p.name for p in removed))

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

    def _restore_loaded(self) -> bool:
        """Put the config that runs back on disk, for a master restart to load (after a reload
        HAProxy refused: nothing is pending any more)."""
        if self._pending is not None:
            self._pending = None
            self._persist()
        self._on_disk_sha = None
        self._write_back()
        return self.loaded is None or self._on_disk_sha == self.loaded.sha256

    async def _call_hook(self, name: str, *args: object) -> None:
        # A component's failure must not stop a reload that protects the fleet from stale configs.
        try:
            await getattr(self.hooks, name)(*args)
        except Exception:
            log.exception("hook %s raised", name)

    # ------------------------------------------------------------ generations

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
            self.problems.report("generations index", exc, f"cannot record the generations: {io_error_line(exc)}")
            return
        self.problems.clear("generations index")

    def _observe(self, procs: ProcList) -> None:
        """Prune dead generations and enforce old_workers.max from one `show proc` answer."""
        self.last_procs = procs
        live = {p.pid for p in (*procs.workers, *procs.old_workers)}
        gone = prunable(self.state.generations, live, self.state.current_generation)
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

    # ------------------------------------------------------------ convergence

    def _assess(self, record: ReloadRecord | None) -> None:
        """Compare what the current worker runs (from `show proc`) with the goal; when they differ
        after a failed or unconfirmed attempt, set the next attempt, with backoff."""
        convergence = self.state.convergence
        current = self.state.current
        runs = None if current is None else (current.effective_sha256, self._inputs.get(current.number))
        if (
            self.master.up
            and self.state.master_socket_ok
            and self._unconfirmed is None
            and not self.scheduler.pending
            and runs_goal(self._goal, runs)
        ):
            if not convergence.converged:
                # A write that changed nothing, or a reload that went through, says so itself.
                routine = convergence.attempts == 0 and convergence.reason == "a change is pending"
                log.log(logging.DEBUG if routine else logging.INFO,
                        "converged: worker %s runs the rendered config (sha256=%s) after %.1fs, %d retries",
                        current.worker_pid if current else None, self._goal[0][:12] if self._goal else None,
                        convergence.unconverged_s(utcnow()), convergence.attempts)
            convergence.reached()
            return
        if record is not None and record.result == "invalid":
            self.scheduler.retry(None)
            convergence.next_attempt_at = None
            convergence.missed(f"the rendered config is invalid: {one_line(record.error or '', 200)}", transient=False)
            return
        if not self.master.up:
            convergence.missed("the HAProxy master is not running", transient=True)
        elif not self.state.master_socket_ok:
            convergence.missed(f"{self.settings.haproxy.master_socket_path} is missing", transient=True)
        elif record is not None and record.result in ("failed", "unknown"):
            error = one_line(record.error or "", 200)
            why = f"HAProxy refused the new config: {error}" if self._refused else f"reload {record.result}: {error}"
            convergence.missed(why, transient=not self._refused)
        elif self._unconfirmed is not None:
            convergence.missed("HAProxy has not confirmed the last reload yet", transient=True)
        elif convergence.converged or record is not None:
            why = "the current worker does not run the rendered config"
            convergence.missed("a change is pending" if self.scheduler.pending else why, transient=True)
        if self._refused and record is not None and record.result == "failed":
            # Not retried by itself: HAProxy refused the config (a port in use), and while it tries
            # one (2.6: "Paused frontend") the serving worker's listeners accept nothing. The next
            # change, SIGHUP or POST /reload tries again.
            self.scheduler.retry(None)
            convergence.next_attempt_at = None
            log.warning("not converged: %s; not retried until the config changes or a reload is asked for",
                        convergence.reason)
            return
        if record is not None and record.result in ("failed", "unknown") and self.scheduler.retry_at is None:
            delay = retry_delay(convergence.attempts, self.settings.reload.retry_max_s)
            convergence.attempts += 1
            convergence.next_attempt_at = utcnow() + timedelta(seconds=delay)
            self.scheduler.retry(time.monotonic() + delay)
            self._wake.set()
            log.warning("not converged for %.1fs: %s; attempt %d in %.1fs",
                        convergence.unconverged_s(utcnow()), convergence.reason, convergence.attempts, delay)

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
            self._on_disk_sha = None
            self._write_back()
            if self._on_disk_sha is None:
                return
            for number, generation in self.state.generations.items():
                self._write_generation_config(number, generation.model.render())
            self._persisted = None
            self._persist()
        except OSError as exc:
            self.problems.report("runtime_dir", exc, f"cannot recreate {h.runtime_dir}: {io_error_line(exc)}")
            return
        self.problems.clear("runtime_dir")
        before = self.last_procs
        procs = await self.master.reexec(before)
        if procs is None:
            return
        self.state.master_socket_ok = True
        generation = await self.on_master_started(procs)
        log.info("runtime_dir recreated: master pid=%s answers on %s again; generation=%s worker=%s",
                 self.master.pid, h.master_socket_path, generation.number if generation else None,
                 generation.worker_pid if generation else None)

