"""Pure decisions about displaced workers: config digests and the section cache they share, the
servers they know of, the policy for reading server states, and states parsed in parts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rigs.wholes import known_dead_servers, parse_live_states, summarize_states
from supervisor.haproxy.answers import servers_state_parts
from supervisor.steering.dead import Sections, live_view
from supervisor.steering.live import LiveStates, LiveTally
from supervisor.steering.plan import Planner
from tests.support.steering_cases import NEW, OLD, dead_in, digest, model, random_config, random_model
from tests.test_worker_answers import SERVERS_STATE

# ---------------------------------------------------------------- digests


def test_section_cache_shares_unchanged_sections_between_configs():
    cache = Sections()
    old, new = digest(model(OLD), cache), digest(model(NEW), cache)
    again = digest(model(OLD), cache)
    assert all(again.sections[name] is section for name, section in old.sections.items())
    changed = {s.name for s in old.section_set - new.section_set}
    assert changed == {"echo", "highscale", "wide", "nobackup", "parked"}
    same = NEW.replace("backend parked\n    server p2 10.0.0.2:8006\n", "backend parked\n    server p2 10.0.0.2:8006\n")
    assert digest(model(same), cache).sections["echo"] is new.sections["echo"]


def test_a_new_slot_table_name_does_not_unshare_the_sections_that_did_not_change(tmp_path: Path):
    """A moved replica renames the slot table in every guarded section's rules: the sections
    whose servers did not change must keep their digest (one copy per distinct section)."""
    from supervisor.effective import build_effective
    from supervisor.settings import HAProxySettings, Settings

    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path))
    old, new = build_effective(settings, OLD), build_effective(settings, NEW)
    assert old.slot_table is not None and new.slot_table is not None
    assert old.slot_table.path != new.slot_table.path
    cache = Sections()
    before = digest(old.effective_model, cache)
    after = digest(new.effective_model, cache)
    changed = {s.name for s in before.section_set - after.section_set}
    assert changed == {"echo", "highscale", "wide", "nobackup", "parked"}
    same = build_effective(settings, OLD.replace("server echo_r1 10.0.0.1:8001", "server echo_r7 10.0.0.1:8001"))
    again = digest(same.effective_model, cache)
    assert {s.name for s in again.section_set - before.section_set} == {"echo"}


def test_dead_sets_are_the_same_with_shared_and_separate_digests():
    rng = random.Random(7)
    base = [(f"b{b}", [f"10.0.{b}.{i}:80" for i in range(4)]) for b in range(12)]

    def text(drop: set[tuple[int, int]]) -> str:
        out = "defaults\n    mode http\n"
        for b, (name, addresses) in enumerate(base):
            out += f"backend {name}\n"
            for i, address in enumerate(addresses):
                if (b, i) not in drop:
                    out += f"    server s{i} {address}\n"
            out += "    server bk 10.9.9.9:80 backup\n"
        return out

    cache = Sections()
    for _ in range(30):
        gen_drop = {(rng.randrange(12), rng.randrange(4)) for _ in range(rng.randrange(4))}
        new_drop = gen_drop | {(rng.randrange(12), rng.randrange(4)) for _ in range(rng.randrange(6))}
        g, n = model(text(gen_drop)), model(text(new_drop))
        operator = {f"b{rng.randrange(12)}/s{rng.randrange(4)}"}
        live = summarize_states([])
        latest = digest(n, cache)
        shared = dead_in(digest(g, cache), latest, live_view(latest, live, operator))
        assert shared == known_dead_servers(g, n, [], operator)
        assert len(shared) >= len(new_drop - gen_drop)


# ---------------------------------------------------------------- the server index, the read policy


@pytest.mark.parametrize("seed", range(4))
def test_has_server_answers_for_exactly_the_servers_of_the_configs_in_use(seed):
    from datetime import UTC, datetime

    from supervisor.state import Generation
    from supervisor.steering.dead import Digests

    rng = random.Random(seed)
    digests = Digests()
    in_use: list[Generation] = []
    for number in range(60):
        if in_use and rng.random() < 0.4:
            in_use.pop(rng.randrange(len(in_use)))
            if in_use and rng.random() < 0.5:  # a round forgets the configs no longer in use
                digests.keep_only(in_use, digests.of(in_use[0]))
        else:
            in_use.append(Generation(number, random_model(rng), f"sha{number}", f"r{number}", datetime.now(UTC)))
        for b in range(8):
            for name in ("s0", "s1", "s2", "bk"):
                key = f"be{b}/{name}"
                assert digests.has_server(key, in_use) == any(key in g.model.server_map() for g in in_use), key


def test_server_states_are_read_often_only_where_they_can_change_by_themselves_unheard():
    from supervisor.steering.live import UNHEARD_SAFETY_NET_S, live_read_interval

    plain = digest(model("backend b\n  server s1 10.0.0.1:80\n  server s2 10.0.0.2:80 backup\n"))
    checked = digest(model("backend b\n  server s1 10.0.0.1:80 check\n"))
    observed = digest(model("backend b\n  server s1 10.0.0.1:80 check observe layer4\n"))
    agent = digest(model("backend b\n  server s1 10.0.0.1:80 agent-check agent-port 9\n"))
    quiet = digest(model("global\n  quiet\nbackend b\n  server s1 10.0.0.1:80 check\n"))
    assert not plain.changes_alone
    assert checked.changes_alone and observed.changes_alone and agent.changes_alone
    assert quiet.quiet and not checked.quiet

    def interval(d, heard: bool, cost_s: float = 0.001, unchecked: bool = False) -> float:
        return live_read_interval(
            cost_s, 0.25, 60.0, changes_alone=d.changes_alone, heard=heard and not d.quiet, unchecked=unchecked
        )

    # HAProxy's lines not heard (a master not started by this daemon, or `quiet`): polled.
    assert interval(plain, heard=False) == UNHEARD_SAFETY_NET_S  # only an admin command changes them
    assert interval(checked, heard=False) == 0.25  # every poll
    assert interval(checked, heard=False, cost_s=0.05) == pytest.approx(1.0)  # a costly read: less often
    assert interval(quiet, heard=True) == 0.25  # HAProxy writes nothing
    # Heard: a line calls for a read; the full read is a safety net.
    assert interval(plain, heard=True) == interval(checked, heard=True) == interval(observed, heard=True) == 60.0
    assert interval(checked, heard=True, unchecked=True) == 0.25  # a first check finding a server UP is silent
    assert interval(plain, heard=True, unchecked=True) == 60.0


@pytest.mark.parametrize("seed", range(6))
def test_a_worker_record_knows_every_backend_its_map_may_differ_in(seed):
    """Plans arrive one after another (drains, evidence, the servers the worker skips, the next
    config and the current one taking turns) while pushes succeed now and then: whatever the
    sequence, every backend where the map differs from the plan is one the record will push."""
    from supervisor.steering.rounds import WorkerRecord

    rng = random.Random(seed)
    cache = Sections()
    generation = random_config(rng, cache)
    servers = [s for sd in generation.sections.values() for s in sd.servers]
    planner = Planner("fail-fast")
    latests = [random_config(rng, cache) for _ in range(3)]
    record = WorkerRecord(1, 1, held={}, pending=set())
    for _ in range(60):
        latest = rng.choice(latests)
        down = frozenset(f"{s.backend} {s.endpoint}" for s in rng.sample(servers, rng.randint(0, 2)))
        skipped = frozenset(s.key for s in rng.sample(servers, rng.randint(0, 1)))
        steering = planner.plan(latest, live_view(latest, LiveStates(down=down), ()), {1: (generation, skipped)})[1]
        record.want(steering)
        held = record.held
        assert held is not None
        differ = {b for b in held.keys() | steering.parts.keys() if held.get(b) != steering.parts.get(b)}
        assert record.pending is None or differ <= record.pending, (differ, record.pending)
        if rng.random() < 0.3:  # a push went through
            record.held, record.pending = steering.parts, set()


def big_states_answer(rows: int) -> str:
    """A `show servers state` of `rows` servers in backends of ten: every seventh DOWN, and
    b0's first server DOWN at an address where b0's last one is alive, rows apart."""
    header = SERVERS_STATE.splitlines()[1]
    lines = ["1", header]
    for i in range(rows):
        backend, op = f"b{i % 10}", "0" if i % 7 == 3 else "2"
        address = "10.9.9.9" if i in (0, rows - 10) else f"10.0.{i // 250}.{i % 250}"
        op = "0" if i == 0 else op
        lines.append(f"2 {backend} {i} s{i} {address} {op} 0 1 1 0 6 3 4 6 0 0 0 - 80 - 0 0 - - 0")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("rows_per_part", [1, 7, 100, 2000, 1_000_000])
def test_states_parsed_in_parts_are_the_states_parsed_whole(rows_per_part: int):
    answer = big_states_answer(5000)
    whole = parse_live_states(answer)
    tally = LiveTally()
    parts = list(servers_state_parts(answer, rows_per_part))
    for part in parts:
        tally.add(part)
    assert tally.result() == whole
    assert len(parts) == -(-5001 // rows_per_part)  # the rows, and the empty line after the last
    assert "b0 10.9.9.9:80" not in whole.down and "b3 10.0.0.3:80" in whole.down
    if len(parts) > 1:  # control: each part's own verdict calls b0's shared address dead
        assert any("b0 10.9.9.9:80" in parse_live_states(part).down for part in parts)
