"""Pure decisions about displaced workers: known-dead servers, steer-map entries, map diffs, parsers."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from supervisor.haproxy.answers import (
    Proc,
    ProcList,
    ServerState,
    parse_servers_state,
    servers_state_parts,
    show_info_by_pid,
)
from supervisor.haproxy.config import Config
from supervisor.haproxy.guard import backend_of_key, slot_table
from supervisor.state import Generation
from supervisor.steering.dead import ConfigDigest, Sections, dead_groups, line_limit, live_view
from supervisor.steering.entries import FAIL_FAST
from supervisor.steering.lines import answer_problem, delta_lines, is_whole_answer, map_entries, phase_lines
from supervisor.steering.mapdiff import ROUTING_PHASES, BackendDelta, Phase, backend_delta, diff_phases
from supervisor.steering.plan import Planner
from supervisor.steering.procs import stuck_sessions, worker_generations
from supervisor.steering.states import LiveStates, LiveTally
from tests.support.wholes import (
    diff_map,
    inject_guard,
    known_dead_servers,
    map_commands,
    parse_live_states,
    steer_entries,
    steered_servers,
    summarize_states,
)

MAP = "/run/hs/steer.map"
TABLE = "/run/hs/slots-0.map"

OLD = """\
defaults
    mode http
backend echo
    server echo_r1 10.0.0.1:8001 check
    server fallback 10.0.9.9:8000 check backup
backend highscale
    server hs_r1 10.0.0.1:8002 check
    server hs_r2 10.0.0.1:8003 check
    server fallback 10.0.9.9:8000 check backup
backend wide
    server wide_r1 10.0.0.1:8004 check
    server wide_r2 10.0.0.2:8004 check
    server wide_r3 10.0.0.3:8004 check
    server fallback 10.0.9.9:8000 check backup
backend nobackup
    server nb_r1 10.0.0.1:8005 check
    server nb_r2 10.0.0.2:8005 check
backend parked
    server p1 10.0.0.1:8006 disabled
    server p2 10.0.0.2:8006
"""

# node 10.0.0.1 drained: its replicas moved to 10.0.0.4
NEW = """\
defaults
    mode http
backend echo
    server echo_r9 10.0.0.4:8001 check
    server fallback 10.0.9.9:8000 check backup
backend highscale
    server hs_r8 10.0.0.4:8002 check
    server hs_r9 10.0.0.4:8003 check
    server fallback 10.0.9.9:8000 check backup
backend wide
    server wide_r9 10.0.0.4:8004 check
    server wide_r2 10.0.0.2:8004 check
    server wide_r3 10.0.0.3:8004 check
    server fallback 10.0.9.9:8000 check backup
backend nobackup
    server nb_r9 10.0.0.4:8005 check
    server nb_r2 10.0.0.2:8005 check
backend parked
    server p2 10.0.0.2:8006
"""


def routes(config: Config, entries: dict[str, str], backend: str) -> list[str]:
    """The server each slot a steered request can pick resolves to, as the guard's rules
    resolve it: the steer map's entry for the slot, else the slot table's."""
    table = dict(slot_table(config)).get(backend, [])
    count = int(entries.get(f"{backend}_n", "-1"))
    return [entries.get(f"{backend}_{i}", table[i] if i < len(table) else "<none>") for i in range(count)]


def home_entries(entries: dict[str, str], slots: int) -> dict[str, str]:
    """The count and the overrides of table slots, without the draw slots past the table."""
    return {k: v for k, v in entries.items() if k.endswith("_n") or int(k.rpartition("_")[2]) < slots}


def model(text: str) -> Config:
    return inject_guard(Config.parse(text), MAP, TABLE)


def digest(config: Config, cache: Sections | None = None) -> ConfigDigest:
    return (cache if cache is not None else Sections()).digest(config)


def steer_map_entries(
    config: Config, dead: frozenset[str], no_backup: str, unusable: frozenset[str] = frozenset()
) -> dict[str, str]:
    return steer_entries(digest(config), dead, no_backup, unusable)  # type: ignore[arg-type]


def dead_in(generation: ConfigDigest, latest: ConfigDigest, view) -> frozenset[str]:
    return frozenset().union(*dead_groups(generation, latest, view).values())


def state(key: str, address: str, op: int = 2, admin: int = 0, weight: int = 1) -> ServerState:
    backend, _, name = key.partition("/")
    host, _, port = address.partition(":")
    return ServerState(backend, name, host, int(port), op, admin, weight)


def live_of(text: str, down: set[str] = frozenset(), maint: set[str] = frozenset()) -> list[ServerState]:
    return [
        state(s.key, s.endpoint, op=0 if s.key in down else 2, admin=1 if s.key in maint else 0)
        for s in Config.parse(text).servers()
    ]


# ---------------------------------------------------------------- known-dead rules


def test_a_servers_dropped_or_moved_by_the_latest_config_are_dead():
    dead = known_dead_servers(model(OLD), model(NEW), live_of(NEW), set())
    assert dead == {"echo/echo_r1", "highscale/hs_r1", "highscale/hs_r2", "wide/wide_r1", "nobackup/nb_r1"}
    # p1 is disabled in the old worker's own config: never routed to, never counted


def test_dead_groups_per_backend():
    cache = Sections()
    old, new = digest(model(OLD), cache), digest(model(NEW), cache)
    view = live_view(new, summarize_states(live_of(NEW)), {"wide/wide_r2"})
    assert dead_groups(old, new, view) == {
        "echo": {"echo/echo_r1"},
        "highscale": {"highscale/hs_r1", "highscale/hs_r2"},
        "wide": {"wide/wide_r1", "wide/wide_r2"},  # wide_r2 by the operator
        "nobackup": {"nobackup/nb_r1"},
    }
    # the latest config against itself: only the operator's mark
    assert dead_groups(new, new, view) == {"wide": {"wide/wide_r2"}}


def random_config(rng: random.Random, cache: Sections) -> ConfigDigest:
    text = "defaults\n    mode http\n"
    for b in rng.sample(range(8), rng.randint(1, 8)):
        servers = [f"    server s{r} 10.0.{rng.randint(0, 2)}.{r}:80\n" for r in range(rng.randint(1, 3))]
        text += f"backend be{b}\n" + "".join(servers) + ("    server bk 10.9.9.9:80 backup\n" if b % 2 else "")
    return digest(model(text), cache)


@pytest.mark.parametrize("seed", range(6))
def test_a_plan_worked_out_from_the_last_one_equals_one_worked_out_afresh(seed):
    """The planner works a plan out from the last one for the same worker, backend by backend
    where something can have changed. Whatever the drains, evidence, operator marks and the
    servers a worker skips, it must equal a plan made from nothing, and the straight decision."""
    rng = random.Random(seed)
    cache = Sections()
    generations = [random_config(rng, cache) for _ in range(5)]
    planner = Planner("fail-fast")
    latest = random_config(rng, cache)
    for _ in range(30):
        latest = rng.choice([random_config(rng, cache), latest, rng.choice(generations)])
        servers = [s for d in generations for sd in d.sections.values() for s in sd.servers]
        down = frozenset(f"{s.backend} {s.endpoint}" for s in rng.sample(servers, rng.randint(0, 4)))
        marked = {s.key for s in rng.sample(servers, rng.randint(0, 2))}
        view = live_view(latest, LiveStates(down=down), marked)
        skipped = frozenset(s.key for s in rng.sample(servers, rng.randint(0, 1)))
        workers = {pid: (g, skipped if pid % 2 else frozenset()) for pid, g in enumerate(generations)}
        plans = planner.plan(latest, view, workers)
        afresh = Planner("fail-fast").plan(latest, view, workers)
        for pid, (generation, unusable) in workers.items():
            assert dict(plans[pid].groups) == dict(afresh[pid].groups) == dead_groups(generation, latest, view)
            assert plans[pid].entries() == afresh[pid].entries()
            assert plans[pid].entries() == steer_entries(generation, plans[pid].dead, "fail-fast", unusable)
            assert plans[pid].steered == steered_servers(plans[pid].dead, plans[pid].entries())


def test_a_same_name_at_another_port_is_dead_and_a_new_name_at_the_same_address_is_not():
    old = model("backend b\n  server s1 10.0.0.1:80\n  server s2 10.0.0.2:80\n")
    new = model("backend b\n  server s1 10.0.0.1:81\n  server other 10.0.0.2:80\n")
    assert known_dead_servers(old, new, [], set()) == {"b/s1"}


def test_a_backend_the_latest_config_dropped_has_only_dead_servers():
    old = model("backend gone\n  server s1 10.0.0.1:80\n  server bk 10.0.0.9:80 backup\n")
    assert known_dead_servers(old, model("backend other\n  server x 10.0.0.1:80\n"), [], set()) == {
        "gone/s1",
        "gone/bk",
    }


def test_b_down_or_maint_in_the_current_worker_matched_by_backend_and_address():
    live = live_of(NEW, down={"wide/wide_r2"}, maint={"nobackup/nb_r2"})
    dead = known_dead_servers(model(NEW), model(NEW), live, set())
    assert dead == {"wide/wide_r2", "nobackup/nb_r2"}
    # same address in another backend says nothing about this one
    other = [state("elsewhere/x", "10.0.0.3:8004", op=0), *live_of(NEW)]
    assert known_dead_servers(model(NEW), model(NEW), other, set()) == frozenset()


def test_b_matches_an_old_generation_by_address_whatever_the_name():
    live = [*live_of(NEW), state("wide/renamed", "10.0.0.3:8004", op=0)]
    live = [s for s in live if s.key != "wide/wide_r3"]
    assert "wide/wide_r3" in known_dead_servers(model(OLD), model(NEW), live, set())


def test_b_one_live_server_at_the_address_keeps_it_alive():
    live = [*live_of(NEW), state("wide/dup", "10.0.0.2:8004", op=0)]
    assert "wide/wide_r2" not in known_dead_servers(model(NEW), model(NEW), live, set())


def test_b_a_server_up_again_stops_being_dead():
    down = known_dead_servers(model(NEW), model(NEW), live_of(NEW, down={"wide/wide_r2"}), set())
    up = known_dead_servers(model(NEW), model(NEW), live_of(NEW), set())
    assert "wide/wide_r2" in down and "wide/wide_r2" not in up


def test_a_a_server_readded_at_the_same_address_stops_being_dead():
    readded = NEW.replace("server wide_r9 10.0.0.4:8004 check", "server wide_r7 10.0.0.1:8004 check")
    assert "wide/wide_r1" not in known_dead_servers(model(OLD), model(readded), live_of(readded), set())


def test_c_operator_marks_by_name_and_through_the_latest_config_by_address():
    assert known_dead_servers(model(NEW), model(NEW), live_of(NEW), {"wide/wide_r3"}) == {"wide/wide_r3"}
    # an old generation calls the same process by another name
    old = model("backend wide\n  server old_name 10.0.0.3:8004\n")
    assert known_dead_servers(old, model(NEW), live_of(NEW), {"wide/wide_r3"}) == {"wide/old_name"}


def test_host_names_take_the_verdict_of_the_same_named_live_server():
    cfg = model("backend b\n  server s1 node-a.internal:80\n  server s2 node-b.internal:80\n")
    live = [state("b/s1", "10.1.1.1:80", op=0), state("b/s2", "10.1.1.2:80")]
    assert known_dead_servers(cfg, cfg, live, set()) == {"b/s1"}


# ---------------------------------------------------------------- steer entries


def test_entries_spread_over_live_primaries_or_go_to_the_backup():
    old = model(OLD)
    dead = known_dead_servers(old, model(NEW), live_of(NEW), set())
    entries = steer_map_entries(old, dead, "fail-fast")
    assert entries == {
        "echo_0": "fallback",
        "echo_n": "1",
        "highscale_0": "fallback",
        "highscale_n": "1",
        "wide_0": "wide_r2",  # slots 1 and 2 are wide_r2 and wide_r3 in the slot table
        "wide_n": "3",
        "nobackup_0": "nb_r2",
        "nobackup_n": "2",
    }
    assert steered_servers(dead, entries) == sorted(dead)
    assert routes(old, entries, "wide") == ["wide_r2", "wide_r2", "wide_r3"]
    assert routes(old, entries, "highscale") == ["fallback"]


def test_a_second_dead_primary_adds_an_entry_and_changes_none():
    cfg = model("".join(["backend b\n", *(f"  server s{i} 10.0.0.{i}:80\n" for i in range(1, 7))]))
    one = steer_map_entries(cfg, frozenset({"b/s1"}), "fail-fast")
    assert one.keys() == {"b_0", "b_n"} and one["b_n"] == "6" and one["b_0"] != "s1"
    # any other primary but the one slot 0 went to: the count and the first override stay
    for other in (f"s{i}" for i in range(2, 7) if f"s{i}" != one["b_0"]):
        two = steer_map_entries(cfg, frozenset({"b/s1", f"b/{other}"}), "fail-fast")
        slot = int(other[1:]) - 1
        assert two.items() > one.items() and two.keys() - one.keys() == {f"b_{slot}"}
        assert sorted(set(routes(cfg, two, "b"))) == sorted({"s2", "s3", "s4", "s5", "s6"} - {other})
    # the one it went to: that override changes, to a server still alive
    three = steer_map_entries(cfg, frozenset({"b/s1", f"b/{one['b_0']}"}), "fail-fast")
    assert three["b_0"] not in {"s1", one["b_0"]}


def test_every_usable_primary_keeps_its_slot_and_dead_slots_go_to_usable_ones():
    """Whatever is dead, down, disabled or weightless: the slots a request can pick resolve
    to usable primaries only, each usable primary at least to its own slot, else to the
    backup targets once each, else to nothing; the steer map holds one override per
    unusable primary, plus the count; and one more dead server that is no override's target
    leaves every entry there as it was."""
    rng = random.Random(23)
    for _ in range(300):
        size = rng.randint(1, 12)
        lines = []
        for i in range(size):
            extra = rng.choice(["", "", "", " disabled", " weight 0", " backup"])
            lines.append(f"  server s{i} 10.0.0.{i + 1}:80{extra}\n")
        allbackups = "  option allbackups\n" if rng.random() < 0.3 else ""
        cfg = model(f"backend b\n{allbackups}{''.join(lines)}")
        servers = cfg.servers()
        if all(s.backup for s in servers):
            continue
        dead = frozenset(s.key for s in servers if rng.random() < 0.4)
        unusable = frozenset(s.key for s in servers if rng.random() < 0.15)
        entries = steer_map_entries(cfg, dead, "fail-fast", unusable)

        def ok(s, dead=dead, unusable=unusable) -> bool:
            return not s.disabled and s.weight != 0 and s.key not in unusable and s.key not in dead

        primaries, backups = [s for s in servers if not s.backup], [s for s in servers if s.backup]
        if not any(s.key in dead and not s.disabled and s.weight != 0 and s.key not in unusable for s in primaries):
            assert entries == {}
            continue
        usable = sorted(s.name for s in primaries if ok(s))
        live_backups = [s.name for s in backups if ok(s)]
        expected = usable or (live_backups if allbackups else live_backups[:1])
        got = routes(cfg, entries, "b")
        if not expected:
            assert entries == {"b_n": FAIL_FAST}
        elif usable:
            # Past the table's end, the draw slots of weighted_draws() (live primaries only).
            assert len(got) >= len(primaries) and set(got) == set(usable), (lines, dead, unusable, entries)
            home = home_entries(entries, len(primaries))
            assert len(home) - 1 == sum(1 for s in primaries if not ok(s))
            bystanders = [s for s in primaries if ok(s) and s.name not in entries.values()]
            if bystanders:
                more = steer_map_entries(cfg, dead | {rng.choice(bystanders).key}, "fail-fast", unusable)
                more_home = home_entries(more, len(primaries))
                assert more_home.items() - {("b_n", more["b_n"])} >= home.items() - {("b_n", entries["b_n"])}
                assert len(more_home) == len(home) + 1
        else:
            assert sorted(got) == sorted(expected), (lines, dead, unusable, entries)


def test_steered_servers_are_the_dead_ones_whose_backend_has_entries():
    old = model(OLD)
    dead = known_dead_servers(old, model(NEW), live_of(NEW), set()) | {"keeponly/k1"}
    steered = steered_servers(dead, steer_map_entries(old, dead, "keep"))
    assert "echo/echo_r1" in steered
    assert "keeponly/k1" not in steered  # dead, but nothing steers its backend


def test_no_primary_and_no_backup_fails_fast_or_is_left_alone():
    cfg = model("backend b\n  server s1 10.0.0.1:80\n")
    assert steer_map_entries(cfg, frozenset({"b/s1"}), "fail-fast") == {"b_n": FAIL_FAST}
    assert steer_map_entries(cfg, frozenset({"b/s1"}), "keep") == {}


def test_a_dead_backup_is_no_target():
    cfg = model("backend b\n  server s1 10.0.0.1:80\n  server bk 10.0.0.9:80 backup\n")
    assert steer_map_entries(cfg, frozenset({"b/s1", "b/bk"}), "fail-fast") == {"b_n": FAIL_FAST}


def test_first_backup_unless_allbackups():
    text = "backend b\n  server s1 10.0.0.1:80\n  server bk1 10.0.0.8:80 backup\n  server bk2 10.0.0.9:80 backup\n"
    dead = frozenset({"b/s1"})
    assert steer_map_entries(model(text), dead, "fail-fast") == {"b_0": "bk1", "b_n": "1"}
    both = text.replace("backend b\n", "backend b\n  option allbackups\n")
    assert steer_map_entries(model(both), dead, "fail-fast") == {"b_0": "bk1", "b_1": "bk2", "b_n": "2"}


def test_nothing_for_backends_without_dead_primaries_or_without_the_guard():
    cfg = model(OLD)
    assert steer_map_entries(cfg, frozenset({"echo/fallback"}), "fail-fast") == {}
    unguarded = Config.parse(OLD)
    assert steer_map_entries(unguarded, frozenset({"echo/echo_r1"}), "fail-fast") == {}


def test_servers_the_worker_itself_skips_are_no_targets_and_need_no_steering():
    cfg = model(OLD)
    dead = frozenset({"wide/wide_r1"})
    # wide_r2 is DOWN in the old worker itself: a use-server to it would be skipped
    assert steer_map_entries(cfg, dead, "fail-fast", unusable=frozenset({"wide/wide_r2"})) == {
        "wide_0": "wide_r3",
        "wide_1": "wide_r3",
        "wide_n": "3",
    }
    # the dead server is already DOWN there: its own balancing avoids it
    assert steer_map_entries(cfg, dead, "fail-fast", unusable=frozenset({"wide/wide_r1"})) == {}


def test_weight_zero_servers_are_no_targets():
    cfg = model("backend b\n  server s1 10.0.0.1:80\n  server s2 10.0.0.2:80 weight 0\n  server s3 10.0.0.3:80\n")
    assert steer_map_entries(cfg, frozenset({"b/s1"}), "fail-fast") == {"b_0": "s3", "b_1": "s3", "b_n": "3"}


def test_tracking_servers_are_steered_like_any_primary():
    cfg = model(
        "backend b\n  server s1 10.0.0.1:80 check\n  server s2 10.0.0.2:80 check\n"
        "backend via\n  server s1 10.0.0.1:80 track b/s1\n  server s2 10.0.0.2:80 track b/s2\n"
    )
    assert steer_map_entries(cfg, frozenset({"b/s1", "via/s1"}), "fail-fast") == {
        "b_0": "s2",
        "b_n": "2",
        "via_0": "s2",
        "via_n": "2",
    }


# ---------------------------------------------------------------- map diff


def apply(current: dict[str, str], phases: list[Phase], rng: random.Random) -> dict[str, str]:
    """Apply phases the way the lines of phase_lines() reach HAProxy: phases one after the
    other; within one, sets and deletes in any order (separate commands, parallel lines),
    and one backend's adds in order (one payload) at any point among them. After every
    step, no count key may promise a slot that is not there."""
    result = dict(current)
    for phase in phases:
        groups: dict[str, list[tuple[str, str, str | None]]] = {}
        for k, v in phase.adds:
            groups.setdefault(backend_of_key(k), []).append(("add", k, v))
        steps = [[("set", k, v)] for k, v in phase.sets] + [[("del", k, None)] for k in phase.dels]
        steps += list(groups.values())
        rng.shuffle(steps)
        for step in steps:
            for op, key, value in step:
                if op == "add":
                    assert key not in result
                    result[key] = value
                elif op == "set":
                    assert key in result
                    result[key] = value
                else:
                    assert key in result
                    del result[key]
                for k, v in result.items():
                    if k.endswith("_n") and v.isdigit():
                        backend = k[: -len("_n")]
                        assert all(f"{backend}_{i}" in result for i in range(int(v))), (op, key, result)
    return result


def entries_for(rng: random.Random) -> dict[str, str]:
    entries: dict[str, str] = {}
    for backend in rng.sample(["a", "b", "c", "d_1", "e"], rng.randint(0, 5)):
        n = rng.randint(0, 4)
        for i in range(n):
            entries[f"{backend}_{i}"] = rng.choice(["s1", "s2", "s3", "bk"])
        entries[f"{backend}_n"] = str(n)
    return entries


def test_diff_reaches_the_desired_map_and_never_exposes_a_half_state():
    rng = random.Random(4)
    for _ in range(500):
        current, desired = entries_for(rng), entries_for(rng)
        assert apply(current, diff_map(current, desired), rng) == desired
        assert diff_map(desired, desired) == []


def test_diff_phases_order():
    phases = diff_map({"a_0": "s1", "a_1": "s2", "a_n": "2", "gone_0": "x", "gone_n": "1"}, {"a_0": "s3", "a_n": "1"})
    assert phases == [
        # the servers a's overrides leave get hops first, to a server a keeps
        Phase(adds=(("a/s1", "s3"), ("a/s2", "s3"))),
        Phase(sets=(("a_n", "1"),), dels=("gone_n",)),
        Phase(sets=(("a_0", "s3"),), dels=("a_1", "gone_0")),
        Phase(dels=("a/s1", "a/s2")),
    ]
    # a newly steered backend: its slots and then its count, in the first phase
    assert diff_map({}, {"b_n": "2", "b_1": "s2", "b_0": "s1"}) == [
        Phase(adds=(("b_0", "s1"), ("b_1", "s2"), ("b_n", "2")))
    ]
    # a count that grows goes after the slots it needs
    assert diff_map({"b_0": "s1", "b_n": "1"}, {"b_0": "s1", "b_1": "s2", "b_n": "2"}) == [
        Phase(adds=(("b_1", "s2"),)),
        Phase(sets=(("b_n", "2"),)),
    ]


def test_a_drain_that_kills_an_overrides_target_adds_before_it_sets():
    # r1 was dead and its slot went to r2; now r2 dies too.
    phases = diff_phases({"b_0": "r2", "b_n": "3"}, {"b_0": "r3", "b_1": "r3", "b_n": "3"})
    routing, tidying = phases[:ROUTING_PHASES], phases[ROUTING_PHASES:]
    assert [p for p in routing if p] == [Phase(adds=(("b_1", "r3"), ("b/r2", "r3")))]
    assert [p for p in tidying if p] == [Phase(sets=(("b_0", "r3"),)), Phase(dels=("b/r2",))]
    # A hop left over from an interrupted push may point anywhere: the override changes at once.
    phases = diff_phases({"b_0": "r2", "b_n": "3", "b/r2": "r1"}, {"b_0": "r3", "b_1": "r3", "b_n": "3"})
    assert phases[0] == Phase(adds=(("b_1", "r3"),), sets=(("b_0", "r3"),))
    assert phases[1] == Phase(dels=("b/r2",))
    # An override that goes away, its slot's own server back: its old target leaves by a hop.
    phases = diff_phases({"b_0": "r2", "b_1": "r3", "b_n": "3"}, {"b_1": "r4", "b_n": "3"})
    assert phases[0] == Phase(adds=(("b/r3", "r4"), ("b/r2", "r4")))
    # Refused or no longer steered: the count alone decides, and nothing hops.
    assert diff_phases({"b_0": "r2", "b_n": "3"}, {"b_n": "0"})[0] == Phase()
    assert diff_phases({"b_0": "r2", "b_n": "3"}, {})[0] == Phase()


def test_map_commands_are_prefixed_and_idempotent():
    commands = map_commands(42, MAP, {"a_0": "s1", "a_n": "1", "x": "y"}, {"a_0": "s2", "a_n": "1", "b_n": "0"})
    assert commands == [
        f"@!42 add map {MAP} a/s1 s2",  # a hop: requests leave s1 before a_0 changes
        f"@!42 add map {MAP} b_n 0",
        f"@!42 set map {MAP} a_0 s2",
        f"@!42 del map {MAP} x",
        f"@!42 del map {MAP} a/s1",
    ]
    assert map_commands(42, MAP, {"a_n": "0"}, {"a_n": "0"}) == []


@pytest.mark.parametrize("bad", [{"a b_0": "s"}, {"a_0": "s1;@!1 reload"}, {"a_0": "s\nx"}, {"a_0": ""}])
def test_names_are_validated(bad):
    with pytest.raises(ValueError, match="invalid"):
        map_commands(1, MAP, {}, bad)


def test_phase_lines_keep_a_backend_in_one_line():
    adds = tuple((f"be{b:03d}_{i}", f"server{i}") for b in range(60) for i in range(8))
    adds += tuple((f"be{b:03d}_n", "8") for b in range(60))
    phases = diff_map({}, dict(adds))
    lines = phase_lines(3, MAP, phases[0], limit=1000)
    assert len(phases) == 1 and len(lines) > 5
    for line in lines:
        entries = [e.split(" ")[0] for e in line.split("\n")[1:] if e]
        backends = {backend_of_key(k) for k in entries}
        for backend in backends:
            assert f"{backend}_n" in entries and entries.index(f"{backend}_n") == max(
                i for i, k in enumerate(entries) if backend_of_key(k) == backend
            )


def test_phase_lines_use_payloads_within_the_limit():
    adds = tuple((f"backend{i:05d}_{j}", f"server{j}") for i in range(300) for j in range(3))
    sets = tuple((f"x{i}_n", "2") for i in range(400))
    lines = phase_lines(7, MAP, Phase(adds=adds, sets=sets), limit=4000)
    assert all(len(line.encode()) <= 4000 for line in lines)
    payloads = [line for line in lines if "<<" in line]
    singles = [line for line in lines if "<<" not in line]
    assert all(line.startswith(f"@!7 add map {MAP} <<\n") and line.endswith("\n") for line in payloads)
    got = [tuple(entry.split(" ")) for line in payloads for entry in line.split("\n")[1:] if entry]
    assert got == list(adds)
    commands = [c for line in singles for c in line.split(";")]
    assert commands == [f"@!7 set map {MAP} x{i}_n 2" for i in range(400)]


def resolve(entries: dict[str, str], backend: str, slot: int) -> str:
    """Where the guard sends a request that picked `slot`: the override, else the slot table's
    server (`tbl<i>` in these tests), then that server's hop if it has one."""
    server = entries.get(f"{backend}_{slot}", f"tbl{slot}")
    return entries.get(f"{backend}/{server}", server)


def resolved_routes(entries: dict[str, str]) -> dict[str, set[str]]:
    """Per steered backend, the servers its slots resolve to."""
    return {
        k[:-2]: {resolve(entries, k[:-2], i) for i in range(int(v))}
        for k, v in entries.items()
        if k.endswith("_n") and int(v) > 0
    }


def run_lines(
    current: dict[str, str],
    ranks: list[list[str]],
    pid: int,
    rng: random.Random,
    desired: dict[str, str] | None = None,
    routing_ranks: int = 0,
) -> dict[str, str]:
    """Play CLI lines the way HAProxy takes them: ranks in order, a rank's lines in any order
    (parallel connections), each line's commands or payload entries in order. After every
    step, no count key may promise a slot that is not there; and once the first
    `routing_ranks` are played, every request goes where `desired` sends requests."""
    result = dict(current)
    played = 0

    def check() -> None:
        for k, v in result.items():
            if k.endswith("_n") and v.isdigit():
                assert all(f"{k[:-2]}_{i}" in result for i in range(int(v))), result
        if desired is not None and played >= routing_ranks:
            wanted = resolved_routes(desired)
            for backend, servers in resolved_routes(result).items():
                assert backend in wanted and servers <= wanted[backend], (backend, servers, result, desired)

    for lines in ranks:
        if played == routing_ranks:
            check()
        for line in rng.sample(lines, len(lines)):
            head, _, payload = line.partition("\n")
            if head.endswith("<<"):
                assert head == f"@!{pid} add map {MAP} <<"
                for entry in payload.splitlines():
                    key, value = entry.split(" ")
                    assert key not in result
                    result[key] = value
                    check()
                continue
            for command in head.split(";"):
                words = command.split(" ")
                assert words[:4] in ([f"@!{pid}", "set", "map", MAP], [f"@!{pid}", "del", "map", MAP])
                if words[1] == "set":
                    assert words[4] in result
                    result[words[4]] = words[5]
                else:
                    del result[words[4]]
                check()
        played += 1
    return result


def test_delta_lines_merge_backends_and_reach_the_desired_map():
    rng = random.Random(7)
    for _ in range(300):
        backends = [f"be{i}" for i in range(rng.randint(1, 12))]
        before: dict[str, dict[str, str]] = {}
        after: dict[str, dict[str, str]] = {}
        for b in backends:
            for side in (before, after):
                n = rng.choice([None, 0, 1, 2, 5, 40])
                slots = {f"{b}_{i}": f"srv{rng.randint(0, 9)}" for i in range(n or 0)}
                side[b] = {} if n is None else {**slots, f"{b}_n": str(n)}
        deltas = [backend_delta(tuple(sorted(before[b].items())), tuple(sorted(after[b].items()))) for b in backends]
        limit = rng.choice([300, 1000, 16000])
        ranks = delta_lines(9, MAP, deltas, limit)
        assert all(len(line.encode()) <= limit for lines in ranks for line in lines)
        current = {k: v for b in backends for k, v in before[b].items()}
        desired = {k: v for b in backends for k, v in after[b].items()}
        routing = len(delta_lines(9, MAP, deltas, limit, range(ROUTING_PHASES)))
        assert run_lines(current, ranks, 9, rng, desired, routing) == desired
        whole = diff_map(current, desired)
        assert sum(d.changes for d in deltas) == sum(len(p.adds) + len(p.sets) + len(p.dels) for p in whole)
        # the same maps diffed whole, as a worker without per-backend parts is pushed
        whole = [BackendDelta.between(current, desired)]
        whole_lines = delta_lines(9, MAP, whole, limit)
        routing = len(delta_lines(9, MAP, whole, limit, range(ROUTING_PHASES)))
        assert run_lines(current, whole_lines, 9, rng, desired, routing) == desired


def test_a_newly_steered_backend_travels_in_one_payload_line():
    entries = {"app_0": "r2", "app_1": "r3", "app_n": "2"}
    ranks = delta_lines(5, MAP, [BackendDelta.between({}, entries)])
    assert ranks == [[f"@!5 add map {MAP} <<\napp_0 r2\napp_1 r3\napp_n 2\n"]]
    assert delta_lines(5, MAP, [BackendDelta.between(entries, entries)]) == []


def test_map_entries_from_show_map():
    answer = "0x55d1 a_0 s1\n0x55d2 a_n 1\n0x55d3 b_0 s1\n0x55d4 b_0 s2\n0x55d5 c_0 s1\n0x55d6 c_0 s1\n\n"
    assert map_entries(answer) == {"a_0": "s1", "a_n": "1", "b_0": "", "c_0": "s1"}
    assert map_entries("\n") == {}


def test_line_limit_follows_tune_bufsize():
    assert line_limit(Config.parse("global\n  tune.bufsize 8192\n")) == 8192 - 384
    assert line_limit(Config.parse("global\n  maxconn 10\n")) == 16000
    assert line_limit(Config.parse("global\n  tune.bufsize 65536\n")) == 16000


# ---------------------------------------------------------------- processes and parsers


def test_worker_generations_from_show_proc_and_state():
    procs = ProcList(
        Proc(1, "master", 0, "1s", "2.6"), 0, (Proc(30, "worker", 0, "1s", "2.6"),),
        (Proc(20, "worker", 1, "9s", "2.6"), Proc(10, "worker", 2, "20s", "2.6")),
    )
    now = datetime.now(UTC)
    generations = {n: Generation(n, Config.parse(""), "e", "r", now, pid) for n, pid in ((2, 20), (3, 30))}
    assert worker_generations(procs, generations) == {30: 3, 20: 2, 10: None}


def test_split_show_info_of_several_workers():
    text = "Name: HAProxy\nVersion: 2.6.12\nPid: 11\nCurrConns: 3\n\nName: HAProxy\nPid: 12\nCurrConns: 0\n"
    info = show_info_by_pid(text)
    assert info[11]["CurrConns"] == "3" and info[12]["CurrConns"] == "0"


# Captured from HAProxy 2.6.12 (`@!<old pid> show sess`): a stream connecting to a vanished
# server (scb state 5 = CON), one queued in a backend (2 = QUE, no server yet), one established
# (8 = EST), and the CLI's own stream.
SHOW_SESS = (Path(__file__).parent / "captured" / "show_sess_2.6.12.txt").read_text()


def test_stuck_sessions_are_those_still_reaching_a_dead_server():
    assert stuck_sessions(SHOW_SESS, frozenset({"app/r1", "q/s1"})) == ["0x561656a409b0"]
    assert stuck_sessions(SHOW_SESS, frozenset({"app/r3"})) == []


# ---------------------------------------------------------------- live states

# Captured from HAProxy 2.6.12 just after a worker started: `up` passed its first check
# (check result 3), `dead` (a closed port) has not been checked yet (result 0, check state
# 6 = configured|enabled) and `nocheck` has no check (state 0) at the same address.
SERVERS_STATE = (Path(__file__).parent / "captured" / "servers_state_2.6.12.txt").read_text()


def test_parse_live_states_treats_unchecked_servers_as_no_evidence():
    live = parse_live_states(SERVERS_STATE.replace("2 app 3 nocheck", "#"))
    assert live.pending == {"app 127.0.0.1:43157"} and live.down == frozenset()
    assert live.alive_by_key == {"app/dead": None}  # plainly alive servers are not listed
    # a server without check at the same address is evidence that it is alive
    assert parse_live_states(SERVERS_STATE).pending == frozenset()


def test_parse_live_states_down_and_maint():
    down = SERVERS_STATE.replace("2 app 1 up 127.0.0.1 2 0", "2 app 1 up 127.0.0.1 0 0")
    assert parse_live_states(down).down == {"app 127.0.0.1:35137"}
    maint = SERVERS_STATE.replace("2 app 1 up 127.0.0.1 2 0", "2 app 1 up 127.0.0.1 2 1")
    assert parse_live_states(maint).alive_by_key["app/up"] is False
    drain = SERVERS_STATE.replace("2 app 1 up 127.0.0.1 2 0", "2 app 1 up 127.0.0.1 2 8")
    assert "app/up" not in parse_live_states(drain).alive_by_key  # draining is alive


def test_parse_live_states_agrees_with_the_plain_parser_on_op_and_admin_states():
    rows = [("0", "0"), ("2", "0"), ("2", "1"), ("1", "0"), ("3", "4"), ("2", "8"), ("2", "32"), ("0", "8")]
    lines = SERVERS_STATE.splitlines()[:2]
    for i, (op, admin) in enumerate(rows):
        lines.append(f"2 b{i % 3} {i} s{i} 10.0.0.{i} {op} {admin} 1 1 0 6 3 4 6 0 0 0 - 80 - 0 0 - - 0")
    text = "\n".join(lines) + "\n"
    fast = parse_live_states(text)
    plain = summarize_states(parse_servers_state(text))
    assert fast.down == plain.down and fast.pending == plain.pending == frozenset()
    assert {k for k, v in fast.alive_by_key.items() if v is False} == {
        k for k, v in plain.alive_by_key.items() if v is False
    }


def test_a_dead_endpoint_stays_dead_until_the_new_worker_has_checked_it():
    text = "backend app\n  server up 127.0.0.1:35137 check\n  server dead 127.0.0.1:43157 check\n"
    cfg = digest(model(text))
    fresh = parse_live_states(SERVERS_STATE.replace("2 app 3 nocheck", "#"))
    was_down = frozenset({"app 127.0.0.1:43157"})
    assert dead_in(cfg, cfg, live_view(cfg, fresh, (), was_down)) == {"app/dead"}
    assert dead_in(cfg, cfg, live_view(cfg, fresh, ())) == frozenset()  # never seen down: no evidence


def test_digest_based_decisions_match_the_plain_ones():
    old, new = model(OLD), model(NEW)
    live = live_of(NEW, down={"wide/wide_r2"})
    view = live_view(digest(new), summarize_states(live), {"echo/fallback"})
    assert dead_in(digest(old), digest(new), view) == known_dead_servers(old, new, live, {"echo/fallback"})
    dead = dead_in(digest(old), digest(new), view)
    assert steer_entries(digest(old), dead, "fail-fast") == steer_map_entries(old, dead, "fail-fast")


def test_a_backend_too_big_for_one_line_gets_its_count_in_a_later_phase():
    desired = {f"big_{i}": f"a_rather_long_server_name_{i:04d}" for i in range(300)}
    desired["big_n"] = "300"
    phases = diff_map({}, desired)
    assert [len(p.adds) for p in phases] == [300, 1] and phases[1].adds == (("big_n", "300"),)
    assert apply({}, phases, random.Random(1)) == desired


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


def test_answer_problem_needs_one_empty_line_per_command():
    three = "@!1 set map /m a 1;@!1 set map /m b 2;@!1 del map /m c"
    assert answer_problem(three, "\n\n\n") is None
    assert answer_problem(three, "\nentry not found.\n\n\n") == "entry not found."
    assert "connection dropped" in answer_problem(three, "\n")
    assert "connection dropped" in answer_problem("@!1 add map /m <<\nk v\nk2 v\n", "")
    assert answer_problem("@!1 add map /m <<\nk v;x\n", "\n") is None  # payload bytes are not commands


def test_a_show_map_answer_cut_off_is_told_from_a_whole_one():
    # as 2.6.12 answered through the master CLI
    whole = "0x7f8d54046500 k1 v1\n0x556ce3bceab0 k2 v2\n\n"
    assert is_whole_answer(whole) and is_whole_answer("\n")
    for cut in (whole[:-1], whole[:25], whole[: whole.index("\n") + 1], ""):
        assert not is_whole_answer(cut), repr(cut)


# ---------------------------------------------------------------- the server index, the read policy


@pytest.mark.parametrize("seed", range(4))
def test_the_server_index_holds_exactly_the_servers_of_the_configs_in_use(seed):
    from supervisor.steering.digests import ServerIndex

    rng = random.Random(seed)
    cache = Sections()
    index = ServerIndex()
    in_use: list[ConfigDigest] = []
    for _ in range(60):
        if in_use and rng.random() < 0.4:
            index.remove(in_use.pop(rng.randrange(len(in_use))))
        else:
            config = random_config(rng, cache)
            in_use.append(config)  # the same config may be in use twice: counted twice
            index.add(config)
        for b in range(8):
            for name in ("s0", "s1", "s2", "bk"):
                key = f"be{b}/{name}"
                assert (key in index) == any(d.server(key) is not None for d in in_use), key


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
    from supervisor.steering.record import WorkerRecord

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
