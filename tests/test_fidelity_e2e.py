"""A steered old worker routes as HAProxy would, but for the requests HAProxy would send to a
dead server (issue #24), against real HAProxy: the incident of rigs/fidelity.py.

Each test has its control, the same requests under today's override (fidelity_disabled): the
guard draws every steered request at random and loses what each test checks.
"""

from __future__ import annotations

import math

import pytest

from rigs.fidelity import BACKENDS, LIVE, Figures, cookie_of, fidelity_disabled, staged

pytestmark = pytest.mark.haproxy

PERSISTENT = [b for b, (kind, _, _) in BACKENDS.items() if kind in ("cookie", "stick")]
WEIGHTED = [b for b, (kind, _, _) in BACKENDS.items() if kind == "weights"]
HASHED = ["hash_uri", "hash_hdr", "hash_param", "hash_uri_consistent"]


def assert_served(f: Figures) -> None:
    assert f.bad == 0, f"{f.backend}: {f.bad} of {f.total} requests failed or slow"
    assert f.moved_ok == f.movable, f"{f.backend}: {f.movable - f.moved_ok} of {f.movable} left the live servers"


async def test_cookie_and_stick_table_persistence_is_kept_on_live_servers(rundir):
    async with staged(rundir, guard=True) as stage:
        for backend in PERSISTENT:
            f = await stage.measure(backend, requests=150)
            assert_served(f)
            assert f.keepable > 0 and f.kept == f.keepable, f"{backend}: kept {f.kept} of {f.keepable}"
        # A cookie naming the dead server goes where a cookieless request goes: drawn over
        # the live servers (a `use-server` answer carries no inserted cookie, steered or not).
        client = stage.held["ck_insert"][0]
        dead_cookie = {"cookie": cookie_of("ck_insert", "gone") or ""}
        answers = [await client.get("/ck_insert/x", dead_cookie) for _ in range(40)]
        assert not any(a.bad for a in answers) and {a.server for a in answers} == {"s1", "s2"}, answers


async def test_control_todays_override_loses_persistence(rundir, monkeypatch):
    with fidelity_disabled(monkeypatch):
        async with staged(rundir, guard=True) as stage:
            for backend in PERSISTENT:
                f = await stage.measure(backend, requests=150)
                assert_served(f)
                assert f.kept_pct < 80, f"{backend}: kept {f.kept} of {f.keepable} without fidelity"


def share_tolerance(expected: float, requests: int) -> float:
    """Points a measured share may stray from its weight's: the 3 the guard's draws may add
    (tests/test_routing.py holds them to it), and four standard deviations of the sample's own
    noise, so that a correct guard fails one run in many thousands, not one in a few hundred."""
    return 3 + 4 * 100 * math.sqrt(expected * (1 - expected) / requests)


async def test_weight_shares_are_haproxys_own(rundir):
    requests = 5000
    async with staged(rundir, guard=True) as stage:
        for backend in WEIGHTED:
            f = await stage.measure(backend, requests=requests)
            assert_served(f)
            assert set(f.shares) <= set(f.expected), f"{backend}: {f.shares}"
            for server, share in f.expected.items():
                assert f.share_gap(server) < share_tolerance(share, requests), f"{backend}: {f.shares} for {f.expected}"


async def test_control_todays_override_ignores_weights(rundir, monkeypatch):
    with fidelity_disabled(monkeypatch):
        async with staged(rundir, guard=True) as stage:
            gaps = {}
            for backend in WEIGHTED:
                f = await stage.measure(backend, requests=2000)
                assert_served(f)
                gaps[backend] = f.worst_share_gap
            assert gaps["weights"] > 20 and gaps["weights_down"] > 10, gaps


async def test_hash_keys_on_live_servers_keep_them(rundir):
    async with staged(rundir, guard=True) as stage:
        for backend in HASHED:
            f = await stage.measure(backend)
            assert_served(f)
            assert f.movable > 0 and f.kept_pct >= 95, f"{backend}: kept {f.kept} of {f.keepable}"


async def test_control_todays_override_moves_hash_keys(rundir, monkeypatch):
    with fidelity_disabled(monkeypatch):
        async with staged(rundir, guard=True) as stage:
            for backend in HASHED:
                f = await stage.measure(backend)
                assert_served(f)
                assert f.kept_pct < 80, f"{backend}: kept {f.kept} of {f.keepable} without fidelity"


async def test_what_is_not_reproduced_is_still_served_by_live_servers(rundir):
    """The stateful algorithms are drawn (docs/steering.md says how close that is): nothing
    fails, nothing is slow, only live servers answer."""
    async with staged(rundir, guard=True) as stage:
        for backend in ("leastconn", "roundrobin", "first", "random"):
            f = await stage.measure(backend)
            assert_served(f)
            assert set(f.shares) <= set(LIVE), f"{backend}: {f.shares}"


async def test_control_haproxy_alone_sends_requests_to_the_dead_server(rundir):
    """Without the guard the old worker still sends its share to `gone`: each such request
    waits `timeout connect` and is redispatched, or fails. `random` draws, so each backend gets
    requests one at a time until one is bad: nine in a row miss `gone` one time in forty, forty
    in a row about once in ten million."""
    async with staged(rundir, guard=False) as stage:
        for backend in ("leastconn", "roundrobin", "random"):
            for _ in range(40):
                if (await stage.measure(backend, requests=1)).bad:
                    break
            else:
                pytest.fail(f"{backend}: 40 requests, none failed or slow without the guard")
