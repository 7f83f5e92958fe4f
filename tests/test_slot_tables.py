"""Slot table files on disk: written once under their content's name, and removed when no
config that may be loaded again names them."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from supervisor.effective import (
    SLOT_TABLE_GRACE_S,
    build_effective,
    remove_stale_slot_tables,
    write_slot_table,
)
from supervisor.haproxy.config import Config
from supervisor.haproxy.guard import SlotTable, inject_guard_and_table
from supervisor.logs import RecurringConditions
from supervisor.reloader.records import ConfigOnDisk, LoadedConfig
from supervisor.settings import HAProxySettings, Settings

RENDERED = "backend b\n  server s1 10.0.0.1:80\n  server s2 10.0.0.2:80\n  server bk 10.0.0.9:80 backup\n"


def table_of(config: Config, directory: Path) -> SlotTable:
    return inject_guard_and_table(config, "/run/hs/steer.map", directory)[1]


def test_the_effective_config_names_the_table_written_before_it(tmp_path: Path):
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path))
    effective = build_effective(settings, RENDERED)
    table = effective.slot_table
    assert table is not None and f"map({table.path})" in effective.text
    disk = ConfigOnDisk(settings, RecurringConditions(logging.getLogger(__name__), logging.ERROR))
    disk.worker_runs(LoadedConfig.of(effective, None))
    assert table.path.read_text() == "b_0 s1\nb_1 s2\n"
    assert settings.haproxy.effective_config.read_text() == effective.text


def test_an_existing_table_is_not_rewritten(tmp_path: Path):
    table = table_of(Config.parse(RENDERED), tmp_path)
    write_slot_table(table)
    before = table.path.stat().st_mtime_ns
    os.utime(table.path, ns=(before - 10**9, before - 10**9))
    write_slot_table(table)
    assert table.path.stat().st_mtime_ns == before - 10**9


def test_stale_tables_go_the_running_one_and_young_ones_stay(tmp_path: Path):
    now = time.time()
    running = table_of(Config.parse(RENDERED), tmp_path)
    other = table_of(Config.parse(RENDERED + "  server s3 10.0.0.3:80\n"), tmp_path)
    young = table_of(Config.parse(RENDERED + "  server s4 10.0.0.4:80\n"), tmp_path)
    for table in (running, other, young):
        write_slot_table(table)
    old = now - SLOT_TABLE_GRACE_S - 1
    for table in (running, other):
        os.utime(table.path, (old, old))
    unrelated = tmp_path / "steer.map"
    unrelated.write_text("")
    os.utime(unrelated, (old, old))

    assert remove_stale_slot_tables(tmp_path, running) == [other.path]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.path.name, young.path.name, "steer.map"])
    # with the guard off nothing is running from a table: every old one goes
    os.utime(young.path, (old, old))
    assert sorted(remove_stale_slot_tables(tmp_path, None)) == sorted([running.path, young.path])
