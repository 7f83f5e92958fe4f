"""Pure decisions about displaced workers: the map diff, phases that reach the desired steer map
and never expose a half state, and the map commands and phase lines built from them."""

from __future__ import annotations

import random

import pytest

from rigs.wholes import diff_map, map_commands
from supervisor.haproxy.guard import backend_of_key
from supervisor.steering.mapdiff import ROUTING_PHASES, Phase, diff_phases, phase_lines
from tests.support.steering_cases import MAP

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


def test_a_backend_too_big_for_one_line_gets_its_count_in_a_later_phase():
    desired = {f"big_{i}": f"a_rather_long_server_name_{i:04d}" for i in range(300)}
    desired["big_n"] = "300"
    phases = diff_map({}, desired)
    assert [len(p.adds) for p in phases] == [300, 1] and phases[1].adds == (("big_n", "300"),)
    assert apply({}, phases, random.Random(1)) == desired
