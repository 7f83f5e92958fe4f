"""What every part of the reloader shares: the hooks plugged into it, its collaborators and
its state. The parts (bookkeeping, convergence, confirm, cycle, recovery) are mixins on top
of `ReloaderBase`, each in its own module; `core.Reloader` puts them together."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

from ..effective import Effective, sha256_text
from ..generations import GenerationStore, PendingReload, Snapshot
from ..haproxy.api import MasterCLI, ProcList
from ..haproxy.config import Config
from ..haproxy.inject import SlotTable
from ..logs import RecurringConditions
from ..master import MasterProcess
from ..notify import Notifier
from ..runlock import RuntimeDirLock
from ..settings import Settings
from ..state import Generation, ReloadRecord, ReloadResult, State, utcnow
from .schedule import Cause, ReloadScheduler
from .watch import ContentCheck, split_watch

log = logging.getLogger(__package__)


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


class ReloaderBase:
    """The collaborators and the state; the methods every part calls."""

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
        reload = settings.reload
        self.scheduler = ReloadScheduler(
            reload.debounce_ms / 1000, reload.min_interval_ms / 1000, reload.max_delay_ms / 1000
        )
        files, dirs = split_watch(settings.haproxy.config, settings.haproxy.watch)
        self.watch_files, self.watch_dirs = files, dirs
        self.watch_ignore = [settings.haproxy.runtime_dir]
        # The safety net under the watches; its first look, taken now, is what later looks compare with.
        self.content = ContentCheck(settings.haproxy.config)
        self.content.commit(*self.content.look())
        self._cycling = False  # a cycle is under way (it reads the rendered config)
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
        # The cycle requests join, by kind ("forced", "asked"), and who asked.
        self._requested: dict[Cause, asyncio.Future[ReloadRecord | None]] = {}
        self._requested_by: list[str] = []
        self._on_disk_sha: str | None = None  # the effective config last written to disk
        self._refused = False  # the last reload failed because HAProxy could not load the config
        self._cli_failed = False  # the master CLI failed to answer, and has not answered since
        self.runtime_lock: RuntimeDirLock | None = None  # the daemon's, renewed when runtime_dir is made again
        self.problems = RecurringConditions(log, logging.ERROR)  # keyed by what fails, caused by the error
        state.rendered_path = str(settings.haproxy.config)
        state.effective_path = str(settings.haproxy.effective_config)

    def changed(self, now: float | None = None) -> None:
        self.scheduler.changed(time.monotonic() if now is None else now)
        if self.state.convergence.converged:
            self.state.convergence.missed("a change is pending", transient=True)
        self._wake.set()

    def being_written(self) -> None:
        """A watched file is being written: not converged from now, read once it is closed."""
        self.scheduler.being_written()
        if self.state.convergence.converged:
            self.state.convergence.missed("a change is being written", transient=True)

    def cli_failed(self) -> None:
        self._cli_failed = True

    def cli_answered(self) -> None:
        """The master CLI answered: after a failure, a pending attempt to converge runs now."""
        if not self._cli_failed:
            return
        self._cli_failed = False
        if self.scheduler.answered_again(time.monotonic()):
            self.state.convergence.next_attempt_at = utcnow()
            log.info("master CLI answers again: attempt %d now", self.state.convergence.attempts)
            self._wake.set()

    def _record(self, result: ReloadResult, started: float, error: str | None = None) -> ReloadRecord:
        return self.state.reloads.record(result, (time.monotonic() - started) * 1000, error)

    async def _call_hook(self, name: str, *args: object) -> None:
        # A component's failure must not stop a reload that protects the fleet from stale configs.
        try:
            await getattr(self.hooks, name)(*args)
        except Exception:
            log.exception("hook %s raised", name)
