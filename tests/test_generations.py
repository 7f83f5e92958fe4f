"""generations.json: round trip, and the plan an adopting daemon follows."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from supervisor.haproxy.answers import Proc, ProcList, parse_show_proc
from supervisor.haproxy.config import Config
from supervisor.reloader.records import (
    GenerationRecord,
    GenerationStore,
    PendingReload,
    Snapshot,
    decode,
    encode,
    loaded_pending,
    plan_rebuild,
    prunable,
)
from supervisor.state import Generation

T0 = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)

PROCS = parse_show_proc(
    "#<PID>          <type>          <reloads>       <uptime>        <version>\n"
    "100             master          3 [failed: 0]   0d00h00m09s     2.6.12\n"
    "# workers\n"
    "303             worker          0               0d00h00m01s     2.6.12\n"
    "# old workers\n"
    "302             worker          1               0d00h00m05s     2.6.12\n"
    "299             worker          3               0d00h00m08s     2.6.12\n"
)


def rec(n: int, pid: int | None) -> GenerationRecord:
    return GenerationRecord(n, pid, f"e{n}", f"r{n}", T0, f"i{n}")


def test_round_trip():
    snap = Snapshot((rec(1, 299), rec(3, 302), rec(4, 303)), 4, 4)
    text = encode(snap)
    assert '"303"' in text and '"current_generation": 4' in text
    back = decode(text)
    assert sorted(back.records, key=lambda r: r.number) == list(snap.records)
    assert back.current == 4 and back.last_number == 4


@pytest.mark.parametrize("text", ["", "[]", '{"version": 9}', '{"version": 1, "workers": {"x": {}}}'])
def test_decode_rejects_with_one_line(text):
    with pytest.raises(ValueError) as err:
        decode(text)
    assert "\n" not in str(err.value)


def test_plan_keeps_live_workers_and_finds_current():
    snap = Snapshot((rec(1, 299), rec(2, 250), rec(3, 302), rec(4, 303)), 4, 4)
    plan = plan_rebuild(snap, PROCS)
    assert [r.number for r in plan.keep] == [1, 3, 4]
    assert [r.number for r in plan.drop] == [2]
    assert plan.current is not None and plan.current.number == 4
    assert plan.unknown_old_pids == ()


def test_plan_without_record_for_current_worker():
    # The daemon died between HAProxy starting worker 303 and recording it.
    snap = Snapshot((rec(1, 299), rec(3, 302)), 3, 3)
    plan = plan_rebuild(snap, PROCS)
    assert plan.current is None
    assert [r.number for r in plan.keep] == [1, 3]


def test_plan_without_any_file():
    plan = plan_rebuild(None, PROCS)
    assert plan.current is None and plan.keep == () and plan.unknown_old_pids == (302, 299)


def listing(current: int, *old: int) -> ProcList:
    return ProcList(Proc(1, "master", 2), 0, (Proc(current, "worker", 0),),
                    tuple(Proc(pid, "worker", 1) for pid in old))


def test_prunable_never_prunes_current():
    model = Config.parse("")
    gens = {n: Generation(n, model, "e", "r", T0, pid) for n, pid in ((1, 10), (2, 20), (3, 30))}
    assert prunable(gens, listing(40, 20), current=3) == [1]
    assert prunable(gens, listing(30, 10, 20), current=3) == []


def test_an_answer_without_the_master_prunes_nothing():
    """A master re-executing mid-reload can close a `show proc` connection without a word: an
    empty answer lists no worker, and must not make every old worker's generation gone."""
    model = Config.parse("")
    gens = {n: Generation(n, model, "e", "r", T0, pid) for n, pid in ((1, 10), (2, 20), (3, 30))}
    assert prunable(gens, parse_show_proc(""), current=3) == []


def test_store(tmp_path: Path):
    store = GenerationStore(tmp_path)
    assert store.load() is None
    store.write_config(7, "global\n")
    assert store.read_config(7) == "global\n"
    store.save(Snapshot((rec(7, 70),), 7, 7))
    assert store.load() == Snapshot((rec(7, 70),), 7, 7)
    store.remove_configs([7])
    assert store.read_config(7) is None
    store.index.write_text("not json")
    assert store.load() is None


# PROCS' master has made 3 reloads; its current worker 303 was started by the third.
PENDING = PendingReload("e-new", "r-new", "i-new", master_pid=100, master_reloads=2)


def test_pending_reload_round_trip_and_unreadable_is_dropped():
    snap = Snapshot((rec(1, 299),), 1, 1, PENDING)
    assert decode(encode(snap)) == snap
    assert decode(encode(Snapshot((rec(1, 299),), 1, 1))).pending is None
    broken = encode(snap).replace('"master_pid": 100', '"master_pid": "x"')
    assert decode(broken) == Snapshot((rec(1, 299),), 1, 1)


def test_loaded_pending_only_for_a_worker_the_pending_reload_started():
    assert loaded_pending(PENDING, PROCS, "e-new")
    # Controls: another config on disk, another master, a worker started before it was sent.
    assert not loaded_pending(PENDING, PROCS, "e-other")
    assert not loaded_pending(PendingReload("e-new", "r-new", "i-new", 101, 2), PROCS, "e-new")
    assert not loaded_pending(PendingReload("e-new", "r-new", "i-new", 100, 3), PROCS, "e-new")
    assert not loaded_pending(None, PROCS, "e-new")
