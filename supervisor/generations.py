"""Generations on disk, so a restarted daemon knows what every live worker runs.

`<runtime_dir>/generations/<N>.cfg` is the effective config generation N's worker
started with (or was updated to at runtime); `<runtime_dir>/generations.json` maps
worker PIDs to generations with their checksums and start times. Encoding,
decoding and the adoption plan are pure; the store is a thin file shell.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from .effective import write_atomically
from .files import ensure_private_dir
from .haproxy.answers import ProcList
from .state import Generation, rfc3339

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
    """A reload about to be sent, recorded before it is: a daemon killed before HAProxy's answer
    leaves what the new worker was given (the watched files' digest cannot be read back later)."""

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


def record_of(generation: Generation) -> GenerationRecord:
    return GenerationRecord(
        generation.number,
        generation.worker_pid,
        generation.effective_sha256,
        generation.rendered_sha256,
        generation.started_at,
        generation.inputs_sha256,
    )


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
        "pending_reload": None if snapshot.pending is None else {
            "effective_sha256": snapshot.pending.effective_sha256,
            "rendered_sha256": snapshot.pending.rendered_sha256,
            "inputs_sha256": snapshot.pending.inputs_sha256,
            "master_pid": snapshot.pending.master_pid,
            "master_reloads": snapshot.pending.master_reloads,
        },
    }
    return json.dumps(doc, indent=2) + "\n"


def _decode_pending(entry: object) -> PendingReload | None:
    """The pending reload, or None when absent or unreadable: without it, adoption reloads once
    to be sure, which is safe."""
    if not isinstance(entry, dict):
        return None
    try:
        inputs = entry.get("inputs_sha256")
        return PendingReload(
            str(entry["effective_sha256"]), str(entry["rendered_sha256"]),
            None if inputs is None else str(inputs), int(entry["master_pid"]), int(entry["master_reloads"]),
        )
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
            records.append(
                GenerationRecord(
                    int(e["generation"]), pid, str(e["effective_sha256"]), str(e["rendered_sha256"]),
                    started, e.get("inputs_sha256"),
                )
            )
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
    current: GenerationRecord | None  # None: the running current worker has no record (see below)
    drop: tuple[GenerationRecord, ...]
    unknown_old_pids: tuple[int, ...] = field(default=())


def plan_rebuild(snapshot: Snapshot | None, procs: ProcList) -> RebuildPlan:
    """Match persisted generations to the workers `show proc` lists.

    The current worker having no record means the daemon died between HAProxy starting
    a worker and the daemon writing generations.json (mid-reload or mid-start); the
    caller then builds a generation from the effective config HAProxy loaded.
    """
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
    """Whether the current worker, which has no recorded generation, is the one the pending
    reload started: the same master, a worker started by a reload after it was recorded (by the
    counts `show proc` gives), and the effective config the master re-executed on is the one
    that was sent."""
    master, worker = procs.master, procs.current_worker
    if pending is None or master is None or worker is None or master.pid != pending.master_pid:
        return False
    started_at_reload = master.reloads - worker.reloads
    return started_at_reload > pending.master_reloads and on_disk_sha256 == pending.effective_sha256


def prunable(generations: dict[int, Generation], procs: ProcList, current: int | None) -> list[int]:
    """Generations whose worker `show proc` no longer lists. The current one is never pruned,
    even when a `show proc` taken mid-reload does not list its worker; and an answer without
    the master is none: the master dropped the connection while it re-executed (seen during
    reloads on 2.6 and 3.4), which lists no worker at all."""
    if procs.master is None:
        return []
    live = {p.pid for p in (*procs.workers, *procs.old_workers)}
    return sorted(
        n for n, g in generations.items() if n != current and (g.worker_pid is None or g.worker_pid not in live)
    )


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
