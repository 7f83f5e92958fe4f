"""The steering as a pipeline: decide (dead, entries, plan), diff (mapdiff), wire (lines),
and the shell that applies what pushes and read-backs return. Pure parts, with tables."""

from __future__ import annotations

from unittest import mock

import pytest

from supervisor.effective import build_effective
from supervisor.haproxy.config import Config
from supervisor.settings import HAProxySettings, Settings
from supervisor.steering.dead import Digests

RENDERED = """\
global
    hard-stop-after 5s
defaults
    mode http
    timeout connect 200ms
    timeout client 5s
    timeout server 5s
frontend fe
    bind 127.0.0.1:8080
    default_backend app
backend app
{servers}
"""


def effective_of(tmp_path, servers: list[str]):
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path / "run"))
    lines = "\n".join(f"    server {name} 127.0.0.1:{9000 + i}" for i, name in enumerate(servers))
    return build_effective(settings, RENDERED.format(servers=lines))


async def test_an_effective_config_is_digested_by_its_sha256_without_rendering_it(tmp_path):
    effective = effective_of(tmp_path, ["r1", "r2"])
    same = effective_of(tmp_path, ["r1", "r2"])  # the same content in another object
    digests = Digests()
    with mock.patch.object(Config, "render", side_effect=AssertionError("rendered again")):
        first = await digests.of_effective(effective)
        again = await digests.of_effective(same)  # found by its sha256
    assert again is first
    assert first.sections["app"].by_name.keys() == {"r1", "r2"}
    other = await digests.of_effective(effective_of(tmp_path, ["r2"]))
    assert other.key != first.key


# ---------------------------------------------------------------- decide: record and plan


def _digest(text: str = "defaults\n    mode http\nbackend b\n    server s1 10.0.0.1:80\n"):
    from supervisor.steering.dead import Sections

    return Sections().digest(Config.parse(text))


def _steering(basis, source=("cfg", frozenset()), previous=None, changed=frozenset(), parts=None):
    from supervisor.steering.plan import Steering

    d = _digest()
    return Steering(basis, source, d, d, {}, parts if parts is not None else {}, previous, changed)


def test_pending_after_a_new_plan():
    from supervisor.steering.dead import LiveView
    from supervisor.steering.rounds import pending_after

    view, other = LiveView(), LiveView(down=frozenset({"b 10.0.0.1:80"}))
    one = _steering(("k1", view))
    # (before, after, pending) -> pending after
    table = [
        (None, one, {"a"}, None),  # nothing known before: any backend
        (one, None, {"a"}, None),  # nothing wanted: any
        (one, one, None, None),  # unknown stays unknown
        (one, _steering(("k1", view), source=("other", frozenset())), {"a"}, None),  # another config
        (one, _steering(("k2", view), previous=("k1", view), changed=frozenset({"b"})), {"a"}, {"a", "b"}),
        (one, _steering(("k2", other)), {"a"}, None),  # not worked out from the one held
        (one, _steering(("k1", view)), {"a"}, {"a"}),  # the same basis: nothing more
    ]
    for before, after, pending, expected in table:
        assert pending_after(before, after, pending) == expected, (before, after, pending)


def test_map_deltas_look_only_where_the_map_can_differ():
    from supervisor.steering.dead import LiveView
    from supervisor.steering.rounds import map_deltas

    a, b = (("a_n", "2"), ("a_0", "s2")), (("b_n", "0"),)
    wanted = _steering(("k", LiveView()), parts={"a": a, "b": b})
    # (held, pending) -> backends that get a delta (None: the map is unknown)
    table = [
        (None, None, None),
        ({}, None, {"a", "b"}),
        ({}, {"a"}, {"a"}),  # only where it may differ
        ({"a": a, "b": b}, None, set()),  # in sync
        ({"a": a, "b": b, "c": (("c_n", "1"),)}, None, {"c"}),  # an entry left over
    ]
    for held, pending, backends in table:
        deltas = map_deltas(held, wanted, pending)
        got = None if deltas is None else {_backend_of(d) for d in deltas}
        assert got == backends, (held, pending)
    assert map_deltas({}, None, None) is None


def _backend_of(delta) -> str:
    keys = [k for phase in delta.phases for k, _ in (*phase.adds, *phase.sets)] + [
        k for phase in delta.phases for k in phase.dels
    ]
    return keys[0].partition("_")[0]


def test_reused_plans_are_those_made_for_the_same_worker_content():
    from supervisor.steering.dead import LiveView
    from supervisor.steering.plan import Planner

    one, two = _digest(), _digest("defaults\n    mode http\nbackend b\n    server s2 10.0.0.2:80\n")
    skips = frozenset({"b/s1"})
    planner = Planner("fail-fast")
    last = planner.plan(one, LiveView(), {1: (one, frozenset()), 2: (two, skips)})
    # workers (pid -> config, servers it skips) -> the pids whose last plan holds
    table = [
        ({1: (one, frozenset()), 2: (two, skips)}, {1, 2}),
        ({1: (one, frozenset())}, {1}),  # a worker gone: the others' plans still hold
        ({1: (two, frozenset()), 2: (two, skips)}, {2}),  # another config
        ({1: (one, skips), 2: (two, frozenset())}, set()),  # other servers skipped
        ({1: (one, frozenset()), 3: (one, frozenset())}, {1, 3}),  # a new worker of the same content
    ]
    for workers, expected in table:
        got = planner.plan(one, LiveView(), workers)
        assert {pid for pid in got if got[pid] is last.get(pid, last[1])} == expected, workers
    assert Planner("fail-fast").plan(one, LiveView(), {1: (one, frozenset())})[1] is not last[1]


def test_plans_under_an_older_view_are_let_go_and_the_latest_configs_take_turns():
    from supervisor.steering.dead import LiveView
    from supervisor.steering.plan import Planner

    one, two = _digest(), _digest("defaults\n    mode http\nbackend b\n    server s2 10.0.0.2:80\n")
    worker = {1: (one, frozenset())}
    down, up = LiveView(frozenset({"b 10.0.0.1:80"})), LiveView()
    planner = Planner("fail-fast")
    # (latest config, view) -> whether the plan had to be worked out
    table = [
        ((one, up), True),
        ((two, up), True),  # a reload's next config
        ((one, up), False),  # the current one again: kept while the view holds
        ((two, up), False),
        ((one, down), True),
        ((one, up), True),  # the view went back: its plans were let go
        ((two, up), True),
    ]
    for (latest, view), worked_out in table:
        before = planner.worked_out
        planner.plan(latest, view, worker)
        assert (planner.worked_out > before) == worked_out, (latest is one, view)


def test_no_two_steering_modules_import_each_other():
    import ast
    from pathlib import Path

    import supervisor.steering

    package = Path(supervisor.steering.__file__).parent
    imports: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                names.add(node.module.split(".")[0])
        imports[path.stem] = names
    cycles = sorted((a, b) for a, deps in imports.items() for b in deps if a < b and a in imports.get(b, set()))
    assert cycles == []


# ---------------------------------------------------------------- the shell, against the real HAProxy


@pytest.mark.haproxy
async def test_a_reload_plans_each_worker_once_and_works_each_push_out_once(rundir):
    """Through prepare, before_reload and after_reload (the poll stopped, so only the hooks
    run): one plan per worker, one map_deltas per worker per push round, and each push round
    publishes its records in one call before its pushes and one after."""
    from rigs.harness import KeepAliveClient
    from supervisor.state import State
    from supervisor.steering import rounds as rounds_module
    from supervisor.steering.plan import Planner
    from supervisor.steering.workers import OldWorkers
    from tests.support.old_worker import old_worker, server_lines

    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"]), shutdown_stuck_sessions=False) as env:
        sup = env.sup
        await sup.wait_steered([env.old_pid])
        await sup.stop_displaced()
        planned: list[tuple[str, frozenset[str]]] = []  # the worker contents worked out
        real_work_out = Planner._work_out

        def work_out(self, digest, unusable, latest, view, last):
            planned.append((digest.key, unusable))
            return real_work_out(self, digest, unusable, latest, view, last)

        worked_out: list[str] = []  # the hook that was running, per map_deltas
        hook = ["none"]
        real_deltas = rounds_module.map_deltas

        def map_deltas(held, wanted, pending):
            worked_out.append(hook[0])
            return real_deltas(held, wanted, pending)

        def marked(name):
            real = getattr(OldWorkers, name)

            async def run(self, *args):
                hook[0] = name
                try:
                    return await real(self, *args)
                finally:
                    hook[0] = "none"

            return run

        published: list[str] = []
        real_publish = State.publish_pushes

        def publish_pushes(self, pushes, failures=0):
            published.append("pushes")
            return real_publish(self, pushes, failures)

        leaving = sup.current_pid
        held = await KeepAliveClient(env.front).connect()  # keeps the worker about to become old alive
        assert (await held.get())[0] == 200
        with (
            mock.patch.object(Planner, "_work_out", work_out),
            mock.patch.object(rounds_module, "map_deltas", map_deltas),
            mock.patch.object(State, "publish_pushes", publish_pushes),
            mock.patch.object(OldWorkers, "prepare", marked("prepare")),
            mock.patch.object(OldWorkers, "before_reload", marked("before_reload")),
            mock.patch.object(OldWorkers, "after_reload", marked("after_reload")),
        ):
            try:
                await sup.reload(env.rendered(server_lines(env.ports, ["r2"])))
                assert await sup.map_of(leaving) == {"app_0": "r2", "app_n": "2"}
            finally:
                await held.close()
        assert planned and len(planned) == len(set(planned))  # each worker content once, not once per hook
        # Two push rounds, one map_deltas per worker in each: before_reload's, worked out in
        # prepare while `haproxy -c` runs (the old worker and the one about to become old), and
        # after_reload's (those two and the new current one).
        assert worked_out == ["prepare"] * 2 + ["after_reload"] * 3, worked_out
        assert published == ["pushes"] * 4  # before and after the pushes, in each of the two rounds
        assert await sup.map_of(env.old_pid) == {"app_0": "r2", "app_n": "2"}


# ---------------------------------------------------------------- diff, then wire


def test_diff_phases_table():
    from supervisor.steering.mapdiff import Phase, diff_phases

    # (held, wanted) -> the five phases
    table = [
        ({}, {}, (Phase(), Phase(), Phase(), Phase(), Phase())),
        # newly steered: slots then count, in one payload
        ({}, {"b_0": "s2", "b_n": "2"}, (Phase(adds=(("b_0", "s2"), ("b_n", "2"))), *[Phase()] * 4)),
        # unsteered: the count goes first, then the override
        ({"b_0": "s2", "b_n": "2"}, {}, (Phase(), Phase(dels=("b_n",)), Phase(), Phase(dels=("b_0",)), Phase())),
        # the override's target dies: a hop to the new target routes at once, the override later
        (
            {"b_0": "s2", "b_n": "3"},
            {"b_0": "s3", "b_1": "s3", "b_n": "3"},
            (
                Phase(adds=(("b_1", "s3"), ("b/s2", "s3"))),
                Phase(),
                Phase(),
                Phase(sets=(("b_0", "s3"),)),
                Phase(dels=("b/s2",)),
            ),
        ),
        # refused outright (fail-fast): the count alone decides
        (
            {"b_0": "s2", "b_n": "2"},
            {"b_n": "0"},
            (Phase(), Phase(sets=(("b_n", "0"),)), Phase(), Phase(dels=("b_0",)), Phase()),
        ),
    ]
    for held, wanted, phases in table:
        assert diff_phases(held, wanted) == phases, (held, wanted)


def test_phase_lines_table():
    from supervisor.steering.mapdiff import Phase, phase_lines

    m = "/run/hs/steer.map"
    # (phase, limit, version) -> lines
    table = [
        (Phase(), 16000, None, []),
        (Phase(sets=(("b_0", "s3"),), dels=("b/s2",)), 16000, None, [f"@!7 set map {m} b_0 s3;@!7 del map {m} b/s2"]),
        (Phase(adds=(("b_0", "s2"), ("b_n", "2"))), 16000, None, [f"@!7 add map {m} <<\nb_0 s2\nb_n 2\n"]),
        (Phase(adds=(("b_n", "1"),)), 16000, 4, [f"@!7 add map @4 {m} <<\nb_n 1\n"]),
        # too long for one line: one command per line
        (Phase(dels=("a_0", "b_0")), 60, None, [f"@!7 del map {m} a_0", f"@!7 del map {m} b_0"]),
    ]
    for phase, limit, version, lines in table:
        assert phase_lines(7, m, phase, limit, version) == lines, phase
    with pytest.raises(ValueError, match="invalid map path"):
        phase_lines(7, "relative; show info", Phase(dels=("b_0",)))


def test_answers_to_map_lines_table():
    from supervisor.steering.mapdiff import answer_problem, is_whole_answer, map_entries

    # (line, answer) -> the problem, or None
    table = [
        ("@!7 del map /m a_0", "\n", None),
        ("@!7 del map /m a_0;@!7 del map /m b_0", "\n\n", None),
        ("@!7 del map /m a_0;@!7 del map /m b_0", "\n", "no answer to 1 of 2 commands (connection dropped)"),
        ("@!7 del map /m a_0", "Key not found.\n", "Key not found."),
        ("@!7 add map /m <<\na_0 s1\n", "\n", None),
    ]
    for line, answer, problem in table:
        assert answer_problem(line, answer) == problem, (line, answer)
    # `show map`: whole or cut off, and a key held twice read as "" so that a diff rewrites it
    assert [is_whole_answer(a) for a in ("\n", "0x1 a_0 s1\n\n", "0x1 a_0 s1\n", "")] == [True, True, False, False]
    assert map_entries("0x1 a_0 s1\n0x2 a_n 2\n\n") == {"a_0": "s1", "a_n": "2"}
    assert map_entries("0x1 a_0 s1\n0x2 a_0 s2\n\n") == {"a_0": ""}


def test_a_config_is_digested_in_slices_that_give_the_same_digest():
    from supervisor.steering.dead import Sections

    text = "defaults\n    mode http\n" + "".join(
        f"backend b{i}\n    server s1 10.0.{i // 250}.{i % 250}:80\n" for i in range(450)
    )
    def turns_and_digest(sections: Sections, model: Config, sha256: str | None) -> tuple[int, object]:
        steps, turns = sections.digesting(model, sha256), 0
        while True:
            try:
                next(steps)
                turns += 1
            except StopIteration as done:
                return turns, done.value

    sliced = Sections()
    turns, result = turns_and_digest(sliced, Config.parse(text), "sha")
    assert turns == 450 // Sections.NEW_SLICE  # every section digested anew: the short slices
    assert result == Sections().digest(Config.parse(text))
    assert sliced.digest(Config.parse(text), "sha") is result  # found again by its sha256, in one step
    turns, again = turns_and_digest(sliced, Config.parse(text), None)  # found again section by section
    assert turns == 450 // Sections.SLICE and again == result
