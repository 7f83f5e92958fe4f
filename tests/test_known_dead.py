"""Pure decisions about displaced workers: the known-dead rules (servers the latest config dropped
or moved, down or in maint in the current worker, marked by the operator), per backend."""

from __future__ import annotations

import random

import pytest

from rigs.wholes import known_dead_servers, steer_entries, steered_servers, summarize_states
from supervisor.steering.dead import Sections, dead_groups, live_view
from supervisor.steering.live import LiveStates
from supervisor.steering.plan import Planner
from tests.support.steering_cases import NEW, OLD, digest, live_of, model, random_config, state

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
