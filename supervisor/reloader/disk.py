"""The config on disk: the effective config a restarted master loads, kept what the current
worker runs, and the slot tables it names. `ConfigOnDisk` owns both facts."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..effective import (
    Effective,
    remove_stale_slot_tables,
    sha256_text,
    write_atomically,
    write_effective,
    write_slot_table,
)
from ..haproxy.guard import SLOT_TABLE_PREFIX, SlotTable
from ..logs import RecurringConditions
from ..settings import Settings
from .problems import io_error_line

log = logging.getLogger(__package__)


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


class ConfigOnDisk:
    """What the current worker runs (`loaded`), and the effective config file, written so that
    it is that whenever no reload is in flight: a master restarted then loads what ran."""

    def __init__(self, settings: Settings, problems: RecurringConditions) -> None:
        self.path = settings.haproxy.effective_config
        self.runtime_dir = settings.haproxy.runtime_dir
        self.problems = problems
        self.loaded: LoadedConfig | None = None
        self._on_disk_sha: str | None = None  # the effective config last written to disk

    def runs(self, loaded: LoadedConfig) -> None:
        """The current worker runs `loaded`."""
        self.loaded = loaded

    def write(self, effective: Effective) -> None:
        """The effective config on disk, for a reload or a start to load. OSError when it cannot
        be written, unless the file holds that text already (a full disk has no room for the copy
        an atomic write makes, and needs none)."""
        try:
            write_effective(self.path, effective)
        except OSError:
            if self.previous() != effective.text:
                raise
            write_slot_table(effective.slot_table)  # content-addressed: there, or OSError
        self._on_disk_sha = effective.sha256

    def holds(self, text: str | None) -> None:
        """The file holds `text` (read, or written by an earlier daemon); None: not known."""
        self._on_disk_sha = None if text is None else sha256_text(text)

    def previous(self) -> str | None:
        """The effective config on disk, as an earlier run left it."""
        try:
            return self.path.read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def write_back(self) -> None:
        """The effective config on disk is what a restarted master loads: keep it what runs."""
        loaded = self.loaded
        if loaded is None or loaded.sha256 == self._on_disk_sha:
            return
        try:
            write_slot_table(loaded.slot_table)
            write_atomically(self.path, loaded.text)
            self._on_disk_sha = loaded.sha256
        except OSError as exc:
            error = io_error_line(exc)
            self.problems.happened("effective config", error, f"cannot write back the running config: {error}")
            return
        self.problems.over("effective config")

    def rewrite(self) -> bool:
        """Write what runs again, whatever the file was believed to hold (runtime_dir was lost,
        or a reload was refused); True when the disk now holds what runs."""
        self._on_disk_sha = None
        self.write_back()
        return self.loaded is None or self._on_disk_sha == self.loaded.sha256

    @property
    def rewritten(self) -> bool:
        """Whether a config that runs is on disk (after `rewrite`)."""
        return self._on_disk_sha is not None

    def remove_stale_slot_tables(self, running: Effective) -> None:
        try:
            removed = remove_stale_slot_tables(self.runtime_dir, running.slot_table)
        except OSError as exc:  # a leftover file costs disk space, not the reload
            log.warning("cannot remove old slot tables: %s", exc.strerror or exc)
            return
        if removed:
            log.debug("slot tables removed: %s", ", ".join(p.name for p in removed))

    def slot_table_named(self, text: str) -> SlotTable | None:
        """The slot table file a config names, read from runtime_dir (to write it back with it)."""
        match = re.search(rf"{re.escape(str(self.runtime_dir))}/{SLOT_TABLE_PREFIX}[0-9a-f]+\.map", text)
        if match is None:
            return None
        path = Path(match[0])
        try:
            return SlotTable(path, path.read_text())
        except (OSError, UnicodeDecodeError):
            return None
