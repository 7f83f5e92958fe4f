"""OldWorkers against the real HAProxy: each known-dead rule steers an old worker off a dead
server and unsteers it when the server is back, and fail-fast answers 503 at once where there is
no backup."""

from __future__ import annotations

import pytest

from tests.support.old_worker import answers, old_worker, server_lines, vanish

pytestmark = pytest.mark.haproxy


async def test_down_in_current_worker_steers_and_up_again_unsteers(rundir):
    """Rule (b), without any config change: the current worker's checks find r1 down."""
    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"])) as env:
        sup = env.sup
        node = vanish(env, "r1")
        try:
            await sup.until(lambda: "app/r1" in sup.state.old_workers[env.old_pid].steered, what="r1 steered")
            assert await sup.map_of(env.old_pid) == {"app_0": "r2", "app_n": "2"}
            got = await answers(env.clients[:2])
            assert got and all(status == 200 and body == "r2" and s < 0.25 for status, body, s in got), got
        finally:
            node.close()
        # r1 comes back at the same address: UP again in the current worker, so not dead any more.
        env.started["r1"].start()
        await sup.until(lambda: sup.state.old_workers[env.old_pid].steered == [], what="r1 unsteered")
        assert await sup.map_of(env.old_pid) == {}
        assert "app/r1" not in sup.state.dead_servers
        got = await answers(env.clients[2:], rounds=2)
        assert {body for _, body, _ in got} == {"r1", "r2"}, got  # balanced over both again


async def test_operator_mark_and_unmark(rundir):
    """Rule (c): an operator marks a server dead; every old worker leaves it at once."""
    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"])) as env:
        sup = env.sup
        sup.displaced.mark_dead("app/r2")
        await sup.until(lambda: sup.state.old_workers[env.old_pid].steered == ["app/r2"], what="r2 steered")
        got = await answers(env.clients[:2])
        assert got and all(body == "r1" for _, body, _ in got), got
        sup.displaced.unmark_dead("app/r2")
        await sup.until(lambda: sup.state.old_workers[env.old_pid].steered == [], what="r2 unsteered")
        assert await sup.map_of(env.old_pid) == {}
        with pytest.raises(ValueError, match="invalid"):
            sup.displaced.mark_dead("app/r2;@!1 reload")


async def test_no_backup_fail_fast_answers_503_at_once(rundir):
    """The only replica moved and there is no backup: fail-fast answers at once."""
    async with old_worker(
        rundir,
        lambda p: server_lines(p, ["r1"], backup=None),
        after=lambda p: server_lines(p, ["r9"], backup=None),
    ) as env:
        sup = env.sup
        node = vanish(env, "r1")
        try:
            await sup.wait_steered([env.old_pid])
            assert await sup.map_of(env.old_pid) == {"app_n": "0"}
            got = await answers(env.clients, rounds=2)
            assert got and all(status == 503 and s < 0.25 for status, _, s in got), got
            # the 503 is an answer, not a broken connection: the client may go on
            assert len(got) == 2 * len(env.clients)
        finally:
            node.close()


async def test_no_backup_keep_leaves_routing_alone(rundir):
    async with old_worker(
        rundir,
        lambda p: server_lines(p, ["r1"], backup=None),
        after=lambda p: server_lines(p, ["r9"], backup=None),
        no_backup="keep",
    ) as env:
        sup = env.sup
        await sup.wait_steered([env.old_pid])
        assert sup.state.old_workers[env.old_pid].push.state == "ok"
        assert "app/r1" in sup.state.dead_servers
        assert await sup.map_of(env.old_pid) == {}
        # routing is the old config's: r1 (still running here) answers
        assert {body for _, body, _ in await answers(env.clients[:1])} == {"r1"}
