"""OldWorkers against the real HAProxy through a worker's life: make-before-break and its undo
after a failed reload, prepare and before_reload, a daemon restart, drift repair, and tracking old
workers until they exit."""

from __future__ import annotations

import asyncio
import time

import pytest

from rigs.harness import KeepAliveClient, backends, free_port
from rigs.supervised import supervised
from supervisor.effective import build_effective
from supervisor.haproxy.answers import ProcList
from supervisor.haproxy.api import MasterCLI
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings
from tests.support.old_worker import TEMPLATE, old_worker, server_lines

pytestmark = pytest.mark.haproxy


async def test_make_before_break_and_undo_after_a_failed_reload(rundir):
    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"])) as env:
        sup = env.sup
        current = sup.current_pid
        effective = build_effective(sup.settings, env.rendered(server_lines(env.ports, ["r2"])))
        started = time.monotonic()
        plan = await sup.displaced.before_reload(await sup.displaced.prepare(effective))
        # Before any reload, the worker about to become old already avoids the dropped r1
        # (and so does the older one).
        assert await sup.map_of(current) == {"app_0": "r2", "app_n": "2"}
        assert await sup.map_of(env.old_pid) == {"app_0": "r2", "app_n": "2"}
        log = (time.monotonic() - started, sup.displaced.rounds.last_push)
        fresh = await KeepAliveClient(env.front).connect()
        try:
            bodies = {(await fresh.get())[1] for _ in range(4)}
        finally:
            await fresh.close()
        assert bodies == {"r2"}, (bodies, log)
        # The reload failed: the current worker routes by its config again.
        await sup.displaced.after_reload(plan, False)
        assert await sup.map_of(current) == {}
        assert await sup.map_of(env.old_pid) == {}


async def test_prepare_steers_nothing_and_before_reload_steers_the_same_either_way(rundir):
    """prepare() runs while `haproxy -c` checks the next config, which may fail the check:
    it pushes nothing, whatever polls come meanwhile. before_reload then steers the same maps
    whether polls came between or not (the control)."""
    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"])) as env:
        sup = env.sup
        current = sup.current_pid
        for polled in (True, False):
            # A new Effective each time: plans are found by content, not by object.
            effective = build_effective(sup.settings, env.rendered(server_lines(env.ports, ["r2"])))
            plan = await sup.displaced.prepare(effective)
            if polled:
                await sup.displaced.sync()
                await sup.displaced.sync()
                # Nothing steered: not the old worker, not the one that would become old.
                assert await sup.map_of(current) == {}
                assert await sup.map_of(env.old_pid) == {}
                assert "app/r1" not in sup.state.dead_servers
            plan = await sup.displaced.before_reload(plan)
            assert await sup.map_of(current) == {"app_0": "r2", "app_n": "2"}
            assert await sup.map_of(env.old_pid) == {"app_0": "r2", "app_n": "2"}
            await sup.displaced.after_reload(plan, False)  # the reload failed: back as it was
            assert await sup.map_of(current) == {}
            assert await sup.map_of(env.old_pid) == {}


async def test_daemon_restart_rebuilds_from_the_maps_and_reconcile_repairs_drift(rundir):
    async with old_worker(
        rundir, lambda p: server_lines(p, ["r1", "r2"]), after=lambda p: server_lines(p, ["r9", "r2"])
    ) as env:
        sup = env.sup
        await sup.wait_steered([env.old_pid])
        steered = await sup.map_of(env.old_pid)
        assert steered == {"app_0": "r2", "app_n": "2"}
        await sup.restart(reconcile_interval_s=0.3)
        await sup.wait_steered([env.old_pid])
        # It learnt the map from the old worker and found nothing to change.
        assert sup.displaced.rounds.last_push == {} and sup.state.push_duration.count == 0
        assert sup.state.old_workers[env.old_pid].generation == 1
        assert sup.state.old_workers[env.old_pid].steered == ["app/r1"]
        # Someone empties the map by hand: the next reconcile puts it back.
        await sup.cli.on(env.old_pid, f"clear map {sup.settings.haproxy.steer_map}")
        assert await sup.map_of(env.old_pid) == {}
        async def repaired() -> bool:
            return await sup.map_of(env.old_pid) == steered

        await sup.until(repaired, timeout=5, what="map repaired")


async def test_old_workers_are_tracked_and_dropped_when_they_exit(rundir):
    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"]), clients=2) as env:
        sup = env.sup
        worker = await sup.until(lambda: sup.state.old_workers.get(env.old_pid), what="old worker listed")
        await sup.until(lambda: worker.connections is not None and worker.rss_bytes, what="stats")
        assert worker.generation == 1
        assert worker.connections >= 2  # the held clients (and the keeper)
        assert worker.rss_bytes > 1_000_000
        assert 0 <= worker.age_s() < 60
        assert sup.current_pid not in sup.state.old_workers


async def test_exited_old_worker_leaves_the_list(rundir):
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir), old_workers=OldWorkerSettings(poll_interval_ms=100)
    )
    front = free_port()
    with backends("r1") as started:
        text = TEMPLATE.format(
            front=front, connect_ms=500, retries=1, servers=server_lines({"r1": started["r1"].port}, ["r1"], None)
        )
        async with supervised(settings, text) as sup:
            client = await KeepAliveClient(front).connect()
            assert (await client.get())[0] == 200
            old_pid = sup.current_pid
            await sup.reload(text.replace("backend app\n", "backend app\n    # generation 2\n"))
            await sup.until(lambda: old_pid in sup.state.old_workers, what="old worker listed")
            await client.close()
            started_at = time.monotonic()
            await sup.until(lambda: old_pid not in sup.state.old_workers, timeout=5, what="old worker gone")
            assert time.monotonic() - started_at < 2.0


class CountingCLI(MasterCLI):
    """The master CLI, counting the `show proc` asked through it."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.show_procs = 0

    async def show_proc(self) -> ProcList:
        self.show_procs += 1
        return await super().show_proc()


async def test_at_rest_show_proc_is_asked_now_and_then_and_an_exit_is_noticed_at_once(rundir):
    """Idle means idle: with nothing to push or read, the steering lists the workers every
    LIST_INTERVAL_S, not every poll; an old worker's exit still wakes it at once (pidfd)."""
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir), old_workers=OldWorkerSettings(poll_interval_ms=100)
    )
    front = free_port()
    with backends("r1") as started:
        # No checks: nothing changes the servers' states by itself.
        text = TEMPLATE.format(
            front=front, connect_ms=500, retries=1, servers=f"    server r1 127.0.0.1:{started['r1'].port}\n"
        )
        async with supervised(settings, text) as sup:
            client = await KeepAliveClient(front).connect()
            assert (await client.get())[0] == 200
            old_pid = sup.current_pid
            await sup.reload(text.replace("backend app\n", "backend app\n    # generation 2\n"))
            counting = sup.cli = CountingCLI(sup.cli.path)
            await sup.restart()
            await sup.until(lambda: old_pid in sup.state.old_workers, what="old worker listed")
            await asyncio.sleep(0.5)  # the new component's first rounds: maps read, states read
            before = counting.show_procs
            await asyncio.sleep(3.0)  # 30 polls
            assert counting.show_procs - before <= 3, counting.show_procs - before  # every LIST_INTERVAL_S
            await client.close()
            started_at = time.monotonic()
            await sup.until(lambda: old_pid not in sup.state.old_workers, timeout=5, what="old worker gone")
            assert time.monotonic() - started_at < 1.0  # not waiting for the next listing
