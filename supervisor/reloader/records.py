"""What the reloader records: the generations (`GenerationBook`, also on disk, so a restarted
daemon knows what every live worker runs), the effective config a restarted master loads
(`ConfigOnDisk`), and old_workers.max (`OldWorkerCap`)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

import psutil

from ..effective import Effective, remove_stale_slot_tables, sha256_text, write_slot_table
from ..files import ensure_private_dir, write_atomically
from ..haproxy.answers import Proc, ProcList
from ..haproxy.config import Config
from ..haproxy.guard import SLOT_TABLE_PREFIX, SlotTable
from ..logs import RecurringConditions
from ..settings import Settings
from ..state import Generation, State, rfc3339, utcnow
from .decisions import io_error_line

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class GenerationRecord:
    number: int
    worker_pid: int | None
    effective_sha256: str
    rendered_sha256: str
    started_at: datetime
    inputs_sha256: str | None = None  # digest of the files in haproxy.watch when it was loaded


@dataclass(frozen=True)
class PendingReload:
    """A reload recorded before it is sent: a daemon killed before HAProxy's answer leaves what the
    new worker was given (the watched files' digest cannot be read back later)."""

    effective_sha256: str
    rendered_sha256: str
    inputs_sha256: str | None
    master_pid: int
    master_reloads: int  # the master's reload count (`show proc`) before it was sent


@dataclass(frozen=True)
class Snapshot:
    records: tuple[GenerationRecord, ...]
    current: int | None
    last_number: int
    pending: PendingReload | None = None


def encode(snapshot: Snapshot) -> str:
    workers: dict[str, dict[str, object]] = {}
    unattached: list[dict[str, object]] = []
    for r in sorted(snapshot.records, key=lambda r: r.number):
        entry = {
            "generation": r.number,
            "effective_sha256": r.effective_sha256,
            "rendered_sha256": r.rendered_sha256,
            "inputs_sha256": r.inputs_sha256,
            "started_at": rfc3339(r.started_at),
        }
        if r.worker_pid is None:
            unattached.append(entry)
        else:
            workers[str(r.worker_pid)] = entry
    doc = {
        "version": FORMAT_VERSION,
        "current_generation": snapshot.current,
        "last_generation": snapshot.last_number,
        "workers": workers,
        "unattached": unattached,
        "pending_reload": None if snapshot.pending is None else asdict(snapshot.pending),
    }
    return json.dumps(doc, indent=2) + "\n"


def _decode_pending(entry: object) -> PendingReload | None:
    """None when absent or unreadable: adoption then reloads once to be sure."""
    if not isinstance(entry, dict):
        return None
    try:
        inputs = entry.get("inputs_sha256")
        return PendingReload(str(entry["effective_sha256"]), str(entry["rendered_sha256"]),
                             None if inputs is None else str(inputs), int(entry["master_pid"]),
                             int(entry["master_reloads"]))
    except (KeyError, TypeError, ValueError):
        return None


def decode(text: str) -> Snapshot:
    """Parse generations.json; ValueError with one line naming what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"unknown format (want version {FORMAT_VERSION})")
    records: list[GenerationRecord] = []
    try:
        entries = [(int(pid), e) for pid, e in doc.get("workers", {}).items()]
        entries += [(None, e) for e in doc.get("unattached", [])]
        for pid, e in entries:
            started = datetime.fromisoformat(str(e["started_at"]).replace("Z", "+00:00"))
            records.append(GenerationRecord(int(e["generation"]), pid, str(e["effective_sha256"]),
                                            str(e["rendered_sha256"]), started, e.get("inputs_sha256")))
        current = doc.get("current_generation")
        current = int(current) if current is not None else None
        last = int(doc.get("last_generation") or max((r.number for r in records), default=0))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"bad entry: {exc}") from None
    return Snapshot(tuple(records), current, last, _decode_pending(doc.get("pending_reload")))


@dataclass(frozen=True)
class RebuildPlan:
    """What an adopting daemon keeps: generations whose worker still lives, and which one is current."""

    keep: tuple[GenerationRecord, ...]
    current: GenerationRecord | None  # None: the daemon died before recording the current worker
    drop: tuple[GenerationRecord, ...]
    unknown_old_pids: tuple[int, ...] = field(default=())


def plan_rebuild(snapshot: Snapshot | None, procs: ProcList) -> RebuildPlan:
    records = snapshot.records if snapshot else ()
    current_pid = procs.current_worker.pid if procs.current_worker else None
    live = {p.pid for p in procs.workers} | {p.pid for p in procs.old_workers}
    keep = tuple(r for r in records if r.worker_pid in live)
    drop = tuple(r for r in records if r.worker_pid not in live)
    current = next((r for r in keep if r.worker_pid == current_pid), None)
    known = {r.worker_pid for r in keep}
    unknown_old = tuple(p.pid for p in procs.old_workers if p.pid not in known)
    return RebuildPlan(keep, current, drop, unknown_old)


def loaded_pending(pending: PendingReload | None, procs: ProcList, on_disk_sha256: str) -> bool:
    """Did the pending reload start the current worker (which has no generation)? The same master,
    a worker started by a later reload, and the config sent on disk."""
    master, worker = procs.master, procs.current_worker
    if pending is None or master is None or worker is None or master.pid != pending.master_pid:
        return False
    started_at_reload = master.reloads - worker.reloads
    return started_at_reload > pending.master_reloads and on_disk_sha256 == pending.effective_sha256


def prunable(generations: dict[int, Generation], procs: ProcList, current: int | None) -> list[int]:
    """Generations whose worker `show proc` no longer lists; never the current one (mid-reload its
    worker may be missing), none from an answer without the master (cut as it re-executed)."""
    if procs.master is None:
        return []
    live = {p.pid for p in (*procs.workers, *procs.old_workers)}
    return sorted(n for n, g in generations.items() if n != current and g.worker_pid not in live)


class GenerationStore:
    def __init__(self, runtime_dir: Path) -> None:
        self.directory = runtime_dir / "generations"
        self.index = runtime_dir / "generations.json"

    def config_path(self, number: int) -> Path:
        return self.directory / f"{number}.cfg"

    def write_config(self, number: int, text: str) -> None:
        ensure_private_dir(self.directory)
        write_atomically(self.config_path(number), text)

    def read_config(self, number: int) -> str | None:
        try:
            return self.config_path(number).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def remove_configs(self, numbers: list[int]) -> None:
        for n in numbers:
            self.config_path(n).unlink(missing_ok=True)

    def save(self, snapshot: Snapshot) -> None:
        self.index.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.index, encode(snapshot))

    def load(self) -> Snapshot | None:
        try:
            text = self.index.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("%s: cannot read: %s", self.index, exc.strerror or exc)
            return None
        try:
            return decode(text)
        except ValueError as exc:
            log.warning("%s: ignored: %s", self.index, exc)
            return None


def old_workers_over_max(procs: ProcList, max_old: int) -> list[Proc]:
    olds = sorted(procs.old_workers, key=lambda p: (-p.reloads, p.pid))
    excess = len(olds) - max_old
    return olds[:excess] if excess > 0 else []


class GenerationBook:
    """Owns the generations: numbers them, publishes them into State, records them on disk."""

    def __init__(self, state: State, store: GenerationStore, disk: ConfigOnDisk,
                 problems: RecurringConditions) -> None:
        self.state, self.store, self.disk, self.problems = state, store, disk, problems
        self.last_number = 0
        self.pending: PendingReload | None = None  # the reload sent and not yet decided, as recorded
        self.last_procs: ProcList | None = None  # the last `show proc` answer observed
        self._persisted: Snapshot | None = None

    def worker_started(self, pid: int, model: Config, loaded: LoadedConfig, procs: ProcList | None = None,
                       started_at: datetime | None = None) -> Generation:
        """Worker `pid` runs `loaded`: the next generation, now current; `procs` observed too."""
        self.last_number += 1
        generation = Generation(self.last_number, model, loaded.sha256, loaded.rendered_sha256,
                                started_at or utcnow(), pid, loaded.inputs_sha256)
        self.state.publish_generation(generation, current=True)
        self.pending = None
        self.write_config(generation.number, loaded.text)
        if procs is not None:
            self.observe(procs)
        return generation

    def reload_runs(self, pid: int, effective: Effective, inputs: str, procs: ProcList) -> Generation:
        loaded = LoadedConfig.of(effective, inputs)
        generation = self.worker_started(pid, effective.effective_model, loaded, procs)
        self.disk.worker_runs(loaded)
        return generation

    def kept(self, record: GenerationRecord, model: Config) -> Generation:
        generation = Generation(record.number, model, record.effective_sha256, record.rendered_sha256,
                                record.started_at, record.worker_pid, record.inputs_sha256)
        self.state.publish_generation(generation)
        self.last_number = max(self.last_number, record.number)
        return generation

    def applied_at_runtime(self, current: Generation, runs: Config, effective: Effective, inputs: str, *,
                           whole: bool) -> Generation:
        """The current worker runs `runs`, changed at runtime; unless `whole`, a reload finishes it."""
        if whole:  # HAProxy runs the change already: a failed write is retried, not undone
            self.disk.worker_runs(LoadedConfig.of(effective, inputs))
        generation = replace(current, model=runs, effective_sha256=effective.sha256,
                             rendered_sha256=effective.rendered_sha256)
        self.state.publish_generation(generation, current=whole)
        self.write_config(generation.number, effective.text)
        self.persist()
        return generation

    def sending_reload(self, pending: PendingReload) -> None:
        """Recorded before it is sent: adopting a reload a killed daemon sent costs no reload."""
        self.pending = pending
        self.persist()

    def reload_failed(self) -> bool:
        """No worker runs the reload in flight: the disk is given back what runs (True: it holds it)."""
        self.pending = None
        self.persist()
        return self.disk.rewrite()

    def _written(self, what: str, write: Callable[[], None], failure: str) -> bool:
        """`write()`, its failure (`failure` with its {error}) logged and published as `what`'s."""
        try:
            write()
        except OSError as exc:
            error = io_error_line(exc)
            self.problems.happened(what, error, failure.format(error=error))
            self.state.publish_write(what, error)
            return False
        self.problems.over(what)
        self.state.publish_write(what, None)
        return True

    def write_config(self, number: int, text: str) -> None:
        self._written("generation configs", lambda: self.store.write_config(number, text), (
            f"cannot record generation {number}'s config: {{error}} "
            "(HAProxy runs it; a daemon restarted now would not know its text)"
        ))

    def rewrite_all(self) -> None:
        """Every generation's config and the index again (runtime_dir was lost); OSError raised."""
        for number, generation in self.state.generations.items():
            self.write_config(number, generation.model.render())
        self._persisted = None
        self.persist()

    def persist(self) -> None:
        records = tuple(GenerationRecord(g.number, g.worker_pid, g.effective_sha256, g.rendered_sha256, g.started_at,
                                         g.inputs_sha256) for g in self.state.generations.values())
        snapshot = Snapshot(records, self.state.current_generation, self.last_number, self.pending)
        if snapshot != self._persisted and self._written(
            "generations index", lambda: self.store.save(snapshot), "cannot record the generations: {error}"
        ):
            self._persisted = snapshot

    def observe(self, procs: ProcList) -> None:
        self.last_procs = procs
        gone = prunable(self.state.generations, procs, self.state.current_generation)
        for g in self.state.publish_pruned(gone):
            log.info("generation pruned generation=%d worker=%s: worker gone", g.number, g.worker_pid)
        self.store.remove_configs(gone)
        self.persist()

    def old_count(self) -> int | None:
        return len(self.last_procs.old_workers) if self.last_procs is not None else None


class OldWorkerCap:
    """old_workers.max: the oldest old workers beyond it are sent SIGTERM, once each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._terminated: set[int] = set()  # old workers we sent SIGTERM, until they are gone

    def enforce(self, procs: ProcList, generations: dict[int, Generation]) -> None:
        self._terminated &= {p.pid for p in procs.old_workers}
        victims = [p for p in old_workers_over_max(procs, self.limit) if p.pid not in self._terminated]
        by_pid = {g.worker_pid: n for n, g in generations.items()}
        for proc in victims:
            log.warning(
                "old worker pid=%d generation=%s SIGTERM: %d old workers alive > old_workers.max=%d, oldest first",
                proc.pid, by_pid.get(proc.pid), len(procs.old_workers), self.limit,
            )
            self._terminated.add(proc.pid)
            try:
                # Only a PID `show proc` just listed as an old worker of our master is signalled.
                if psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
                    os.kill(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass


@dataclass(frozen=True)
class LoadedConfig:
    """The effective config on disk that the current worker runs (the last good one)."""

    text: str
    sha256: str  # compared every housekeeping round: a big config is hashed once, not every second
    rendered_sha256: str
    inputs_sha256: str | None
    slot_table: SlotTable | None = None  # the file the config names, rewritten with it after a loss
    # The build's model, if any: a master start on it parses nothing and shares lines with later generations.
    model: Config | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, effective: Effective, inputs: str | None) -> LoadedConfig:
        return cls(effective.text, effective.sha256, effective.rendered_sha256, inputs, effective.slot_table,
                   effective.effective_model)


class ConfigOnDisk:
    """What the current worker runs (`loaded`), and the effective config file, kept that whenever
    no reload is in flight: a master restarted then loads what ran."""

    def __init__(self, settings: Settings, problems: RecurringConditions) -> None:
        self.path = settings.haproxy.effective_config
        self.runtime_dir = settings.haproxy.runtime_dir
        self.problems = problems
        self.loaded: LoadedConfig | None = None
        self._on_disk_sha: str | None = None  # the effective config last written to disk

    def worker_runs(self, loaded: LoadedConfig, on_disk: bool = False) -> None:
        """The current worker runs `loaded` (`on_disk`: the file holds it); other slot tables go."""
        self.loaded = loaded
        if on_disk:
            self._on_disk_sha = loaded.sha256
        self.write_back()
        try:
            removed = remove_stale_slot_tables(self.runtime_dir, loaded.slot_table)
        except OSError as exc:  # a leftover file costs disk space, not the reload
            log.warning("cannot remove old slot tables: %s", exc.strerror or exc)
            return
        if removed:
            log.debug("slot tables removed: %s", ", ".join(p.name for p in removed))

    def loaded_text(self, text: str, rendered_sha256: str, inputs: str | None) -> LoadedConfig:
        return LoadedConfig(text, sha256_text(text), rendered_sha256, inputs, self._slot_table_named(text))

    def write(self, effective: Effective) -> None:
        """The config a reload or a start loads; OSError unless the file holds it already."""
        try:
            write_atomically(self.path, effective.text)
        except OSError:
            if self.previous() != effective.text:
                raise
        self._on_disk_sha = effective.sha256

    def previous(self) -> str | None:
        try:
            return self.path.read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def write_back(self) -> None:
        loaded = self.loaded
        if loaded is None or loaded.sha256 == self._on_disk_sha:
            return
        try:
            write_slot_table(loaded.slot_table)  # first: a config on disk never names a missing table
            write_atomically(self.path, loaded.text)
            self._on_disk_sha = loaded.sha256
        except OSError as exc:
            error = io_error_line(exc)
            self.problems.happened("effective config", error, f"cannot write back the running config: {error}")
            return
        self.problems.over("effective config")

    def rewrite(self) -> bool:
        """Write what runs again, whatever the file was believed to hold; True when it holds it (or nothing runs)."""
        self._on_disk_sha = None
        self.write_back()
        return self.loaded is None or self._on_disk_sha == self.loaded.sha256

    def _slot_table_named(self, text: str) -> SlotTable | None:
        match = re.search(rf"{re.escape(str(self.runtime_dir))}/{SLOT_TABLE_PREFIX}[0-9a-f]+\.map", text)
        if match is None:
            return None
        path = Path(match[0])
        try:
            return SlotTable(path, path.read_text())
        except (OSError, UnicodeDecodeError):
            return None
