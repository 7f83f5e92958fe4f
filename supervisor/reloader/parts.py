"""The reloader's parts, each the owner of its own fields, and the two steps several of them
take together: observing a `show proc` answer, and recording that a new worker runs a config."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..effective import Effective
from ..haproxy.answers import ProcList
from ..haproxy.api import MasterCLI
from ..master import MasterProcess
from ..notify import Notifier
from ..settings import Settings
from ..state import Generation, ReloadRecord, ReloadResult, State
from .confirm import Confirmation
from .decisions import ReloadScheduler
from .hooks import ReloadHooks
from .records import ConfigOnDisk, GenerationBook, LoadedConfig, OldWorkerCap

log = logging.getLogger(__package__)


@dataclass(frozen=True)
class Parts:
    """References, not state: each part owns its fields, and State is written by publishing."""

    settings: Settings
    state: State
    cli: MasterCLI
    master: MasterProcess
    notifier: Notifier
    hooks: ReloadHooks
    scheduler: ReloadScheduler
    book: GenerationBook
    disk: ConfigOnDisk
    confirmation: Confirmation
    cap: OldWorkerCap

    def record(self, result: ReloadResult, started: float, error: str | None = None) -> ReloadRecord:
        """One cycle's outcome, timed from the monotonic `started`, published."""
        return self.state.publish_reload(result, (time.monotonic() - started) * 1000, error)

    def observe(self, procs: ProcList) -> None:
        """Prune dead generations and enforce old_workers.max from one `show proc` answer."""
        self.book.observe(procs)
        self.cap.enforce(procs, self.state.generations)

    def loaded_by(self, effective: Effective, inputs: str, after: ProcList) -> Generation:
        """HAProxy's current worker (from `show proc`) runs `effective`: record it as a generation.
        What HAProxy runs is decided; the writes that follow are bookkeeping, and their failure
        (a full disk) changes nothing of it."""
        worker = after.current_worker
        assert worker is not None
        generation = self.book.started(
            effective.effective_model, effective.sha256, effective.rendered_sha256, inputs, worker.pid
        )
        self.disk.runs(LoadedConfig.of(effective, inputs))
        self.book.decided(persist=False)  # recorded with the observation that follows
        self.book.write_config(generation.number, effective.text)
        self.disk.remove_stale_slot_tables(effective)
        self.observe(after)
        return generation
