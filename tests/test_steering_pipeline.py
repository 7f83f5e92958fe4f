"""The steering as a pipeline: decide (dead, entries, plan), diff (mapdiff), wire (lines),
and the shell that applies what pushes and read-backs return. Pure parts, with tables."""

from __future__ import annotations

from unittest import mock

import pytest

from supervisor.effective import build_effective
from supervisor.haproxy.config import Config
from supervisor.settings import HAProxySettings, Settings
from supervisor.steering.digests import Digests

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


def test_an_effective_config_is_digested_by_its_sha256_without_rendering_it(tmp_path):
    effective = effective_of(tmp_path, ["r1", "r2"])
    same = effective_of(tmp_path, ["r1", "r2"])  # the same content in another object
    digests = Digests()
    with mock.patch.object(Config, "render", side_effect=AssertionError("rendered again")):
        first = digests.of_effective(effective)
        again = digests.of_effective(same)  # found by its sha256
    assert again is first
    assert first.sections["app"].by_name.keys() == {"r1", "r2"}
    other = digests.of_effective(effective_of(tmp_path, ["r2"]))
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
    from supervisor.steering.record import pending_after

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
    from supervisor.steering.record import map_deltas

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
    from supervisor.steering.plan import reused_plans

    one, two = _digest(), _digest("defaults\n    mode http\nbackend b\n    server s2 10.0.0.2:80\n")
    skips = frozenset({"b/s1"})
    last = {
        1: _steering(("k", LiveView()), source=(one.key, frozenset())),
        2: _steering(("k", LiveView()), source=(two.key, skips)),
    }
    # workers (pid -> config, servers it skips) -> the pids whose last plan holds
    table = [
        ({1: (one, frozenset()), 2: (two, skips)}, {1, 2}),
        ({1: (one, frozenset())}, {1}),  # a worker gone: the others' plans still hold
        ({1: (two, frozenset()), 2: (two, skips)}, {2}),  # another config
        ({1: (one, skips), 2: (two, frozenset())}, set()),  # other servers skipped
        ({1: (one, frozenset()), 3: (one, frozenset())}, {1}),  # a new worker: planned
    ]
    for workers, expected in table:
        got = reused_plans(last, workers)
        assert got.keys() == expected, workers
        assert all(got[pid] is last[pid] for pid in got)
    assert reused_plans({}, {1: (one, frozenset())}) == {}


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
    from supervisor.state import State
    from supervisor.steering import record as record_module
    from supervisor.steering.plan import Planner
    from tests.support.harness import KeepAliveClient
    from tests.test_displaced_e2e import old_worker, server_lines

    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"]), shutdown_stuck_sessions=False) as env:
        sup = env.sup
        await sup.wait_steered([env.old_pid])
        await sup.stop_displaced()
        planned: list[int] = []
        real_plan = Planner.plan

        def plan(self, latest, view, workers):
            planned.extend(workers)
            return real_plan(self, latest, view, workers)

        worked_out: list[int] = []
        real_deltas = record_module.map_deltas

        def map_deltas(held, wanted, pending):
            worked_out.append(1)
            return real_deltas(held, wanted, pending)

        published: list[str] = []
        real_publish = State.publish_pushes

        def publish_pushes(self, pushes, failures=0):
            published.append("pushes")
            return real_publish(self, pushes, failures)

        leaving = sup.current_pid
        held = await KeepAliveClient(env.front).connect()  # keeps the worker about to become old alive
        assert (await held.get())[0] == 200
        with (
            mock.patch.object(Planner, "plan", plan),
            mock.patch.object(record_module, "map_deltas", map_deltas),
            mock.patch.object(State, "publish_pushes", publish_pushes),
        ):
            try:
                await sup.reload(env.rendered(server_lines(env.ports, ["r2"])))
                assert await sup.map_of(leaving) == {"app_0": "r2", "app_n": "2"}
            finally:
                await held.close()
        assert sorted(planned) == sorted([env.old_pid, leaving])  # once each, not once per hook
        # Two push rounds, one map_deltas per worker in each: before_reload's (the old worker
        # and the one about to become old), after_reload's (those two and the new current one).
        assert len(worked_out) == 2 + 3, worked_out
        assert published == ["pushes"] * 4  # before and after the pushes, in each of the two rounds
        assert await sup.map_of(env.old_pid) == {"app_0": "r2", "app_n": "2"}
