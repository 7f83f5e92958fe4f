"""OldWorkers against the real HAProxy: each known-dead rule, fail-fast, make-before-break,
a daemon restart, drift repair, tracking old workers, and ending stuck streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.effective import build_effective
from supervisor.haproxy.answers import ProcList, parse_servers_state
from supervisor.haproxy.api import MasterCLI
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings
from tests.support.harness import Backend, KeepAliveClient, VanishedNode, backends, free_port
from tests.support.supervised import Supervised, supervised

pytestmark = pytest.mark.haproxy

# `close-spread-time infinite`: the old worker keeps the clients it holds, idle or not, until
# hard-stop-after. With a window (Ray Serve's template has 60 s) HAProxy closes each of them at
# a random moment in it, or answers it with `connection: close`: a test that counts the answers
# on held connections would then fail at random, more often the slower the machine.
TEMPLATE = """\
global
    hard-stop-after 60s
    close-spread-time infinite

defaults
    mode http
    timeout connect {connect_ms}ms
    timeout check 300ms
    timeout client 30s
    timeout server 30s
    option idle-close-on-response
    retries {retries}
    balance roundrobin

frontend fe
    bind 127.0.0.1:{front}
    default_backend app

backend app
{servers}"""


@dataclass
class Env:
    sup: Supervised
    front: int
    ports: dict[str, int]
    started: dict[str, Backend]
    old_pid: int
    clients: list[KeepAliveClient]  # held by the old worker
    connect_ms: int
    retries: int

    def rendered(self, servers: str) -> str:
        return TEMPLATE.format(front=self.front, connect_ms=self.connect_ms, retries=self.retries, servers=servers)


def server_lines(ports: dict[str, int], names: list[str], backup: str | None = "fallback") -> str:
    lines = [f"    server {n} 127.0.0.1:{ports[n]} check inter 200ms fall 2 rise 1\n" for n in names]
    if backup:
        lines.append(f"    server {backup} 127.0.0.1:{ports[backup]} check inter 200ms backup\n")
    return "".join(lines)


@contextlib.asynccontextmanager
async def old_worker(
    rundir: Path,
    servers: Callable[[dict[str, int]], str],
    after: Callable[[dict[str, int]], str] | None = None,
    clients: int = 4,
    connect_ms: int = 500,
    retries: int = 1,
    **old_workers,
) -> AsyncIterator[Env]:
    """HAProxy with one old worker holding `clients` keep-alive connections (plus a keeper)."""
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir),
        old_workers=OldWorkerSettings(**{"poll_interval_ms": 100, **old_workers}),
    )
    front = free_port()
    with backends("r1", "r2", "r9", "fallback") as started:
        ports = {name: b.port for name, b in started.items()}
        env_text = TEMPLATE.format(front=front, connect_ms=connect_ms, retries=retries, servers=servers(ports))
        async with supervised(settings, env_text) as sup:
            held = [await KeepAliveClient(front).connect() for _ in range(clients)]
            keeper = await KeepAliveClient(front).connect()
            try:
                for client in held:
                    assert (await client.get())[0] == 200
                old_pid = sup.current_pid
                env = Env(sup, front, ports, started, old_pid, held, connect_ms, retries)
                await sup.reload(env.rendered((after or servers)(ports)))
                assert sup.master.worker_pids()[1] == [old_pid]
                yield env
            finally:
                for client in [*held, keeper]:
                    await client.close()


async def answers(clients: list[KeepAliveClient], rounds: int = 2) -> list[tuple[int, str, float]]:
    async def one(client: KeepAliveClient) -> list[tuple[int, str, float]]:
        out = []
        for _ in range(rounds):
            if client.closing:
                break
            out.append(await client.get(timeout=10))
            if out[-1][0] == 0:
                break
        return out

    return [a for batch in await asyncio.gather(*(one(c) for c in clients)) for a in batch]


def vanish(env: Env, name: str) -> VanishedNode:
    env.started[name].stop()
    node = VanishedNode(env.ports[name])
    assert node.connect_hangs()
    return node


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


async def test_make_before_break_and_undo_after_a_failed_reload(rundir):
    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"])) as env:
        sup = env.sup
        current = sup.current_pid
        effective = build_effective(sup.settings, env.rendered(server_lines(env.ports, ["r2"])))
        started = time.monotonic()
        await sup.displaced.before_reload(effective)
        # Before any reload, the worker about to become old already avoids the dropped r1
        # (and so does the older one).
        assert await sup.map_of(current) == {"app_0": "r2", "app_n": "2"}
        assert await sup.map_of(env.old_pid) == {"app_0": "r2", "app_n": "2"}
        log = (time.monotonic() - started, sup.displaced.last_push)
        fresh = await KeepAliveClient(env.front).connect()
        try:
            bodies = {(await fresh.get())[1] for _ in range(4)}
        finally:
            await fresh.close()
        assert bodies == {"r2"}, (bodies, log)
        # The reload failed: the current worker routes by its config again.
        await sup.displaced.after_reload(False)
        assert await sup.map_of(current) == {}
        assert await sup.map_of(env.old_pid) == {}


async def test_prepare_steers_nothing_and_before_reload_steers_the_same_either_way(rundir):
    """prepare() runs while `haproxy -c` checks the next config, which may fail the check:
    it pushes nothing, whatever polls come meanwhile. before_reload then steers the same maps
    whether prepare ran first or not (the control)."""
    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2"])) as env:
        sup = env.sup
        current = sup.current_pid
        for prepared in (True, False):
            # A new Effective each time: plans are found by content, not by object.
            effective = build_effective(sup.settings, env.rendered(server_lines(env.ports, ["r2"])))
            if prepared:
                await sup.displaced.prepare(effective)
                await sup.displaced.sync()
                await sup.displaced.sync()
                # Nothing steered: not the old worker, not the one that would become old.
                assert await sup.map_of(current) == {}
                assert await sup.map_of(env.old_pid) == {}
                assert "app/r1" not in sup.state.dead_servers
            await sup.displaced.before_reload(effective)
            assert await sup.map_of(current) == {"app_0": "r2", "app_n": "2"}
            assert await sup.map_of(env.old_pid) == {"app_0": "r2", "app_n": "2"}
            await sup.displaced.after_reload(False)  # the reload failed: back as it was
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
        await sup.restart_displaced(reconcile_interval_s=0.3)
        await sup.wait_steered([env.old_pid])
        # It learnt the map from the old worker and found nothing to change.
        assert sup.displaced.last_push == {} and sup.state.push_duration.count == 0
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


@pytest.mark.parametrize("sweep", [True, False], ids=["shutdown_stuck_sessions", "control"])
async def test_streams_stuck_on_a_dead_server_are_ended(rundir, sweep):
    """A request already connecting to a vanished server when it is found dead: with the
    option its stream is ended at once; without, it waits out the connect timeout."""
    connect_ms = 2000

    def unchecked(ports: dict[str, int]) -> str:
        # r1 unchecked: the current worker's checks would find it DOWN on their own, and the
        # sweep would end the request before the test marks r1, or before it is connecting.
        return (f"    server r1 127.0.0.1:{ports['r1']}\n"
                f"    server fallback 127.0.0.1:{ports['fallback']} check inter 200ms backup\n")

    async with old_worker(
        rundir,
        unchecked,
        clients=1,
        connect_ms=connect_ms,
        retries=0,
        shutdown_stuck_sessions=sweep,
    ) as env:
        sup = env.sup
        node = vanish(env, "r1")
        try:
            request = asyncio.create_task(env.clients[0].get(timeout=10))

            async def connecting() -> bool:
                return "be=app srv=r1 " in await sup.cli.on(env.old_pid, "show sess")

            await sup.until(connecting, timeout=connect_ms / 1000 / 2, what="the request connecting to r1")
            assert not request.done()
            sup.displaced.mark_dead("app/r1")
            status, _, seconds = await request
        finally:
            node.close()
        assert status != 200
        if sweep:
            assert seconds < connect_ms / 1000 * 0.75, seconds
        else:
            assert seconds >= connect_ms / 1000, seconds



async def test_killing_an_overrides_target_steers_by_a_hop_then_tidies(rundir):
    """A second dead server that an override points to: the push adds a hop for it (with the
    new override, in one payload), changes the old override only after that, then removes
    the hop. The map ends as the decision says, and requests reach the one live primary."""
    async with old_worker(rundir, lambda p: server_lines(p, ["r1", "r2", "r9"])) as env:
        sup = env.sup
        sup.displaced.mark_dead("app/r1")
        await sup.until(lambda: sup.state.old_workers[env.old_pid].steered == ["app/r1"], what="r1 steered")
        target = (await sup.map_of(env.old_pid))["app_0"]
        other = ({"r2", "r9"} - {target}).pop()
        sent: list[str] = []
        execute = sup.displaced.cli.execute

        async def recording(line: str, timeout: float | None = None) -> str:
            sent.append(line)
            return await execute(line, timeout)

        sup.displaced.cli.execute = recording  # type: ignore[method-assign]
        sup.displaced.mark_dead(f"app/{target}")
        await sup.until(
            lambda: sup.state.old_workers[env.old_pid].steered == sorted(["app/r1", f"app/{target}"]),
            what="the target steered",
        )
        slot = {"r2": 1, "r9": 2}[target]
        assert await sup.map_of(env.old_pid) == {"app_0": other, f"app_{slot}": other, "app_n": "3"}
        steer = sup.settings.haproxy.steer_map
        changes = [line for line in sent if " map " in line and not line.split(" ", 2)[1].startswith("show")]
        hop = next(i for i, line in enumerate(changes) if f"\napp/{target} {other}\n" in line)
        moved = next(i for i, line in enumerate(changes) if f"set map {steer} app_0 {other}" in line)
        gone = next(i for i, line in enumerate(changes) if line.endswith(f"del map {steer} app/{target}"))
        assert hop < moved < gone, changes
        got = await answers(env.clients[:2])
        assert got and all(body == other for _, body, _ in got), got


async def test_a_target_the_old_worker_itself_sees_down_is_not_used(rundir):
    """r2 was DOWN when the reload froze the old worker: a `use-server` to it would be skipped
    there (and fall back to balancing, onto the dead r1), so the old worker is sent to the
    backup instead, though r2 is UP again in the current worker."""
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir), old_workers=OldWorkerSettings(poll_interval_ms=100)
    )
    front = free_port()
    with backends("r1", "r2", "fallback") as started:
        ports = {name: b.port for name, b in started.items()}
        started["r2"].stop()
        text = TEMPLATE.format(front=front, connect_ms=500, retries=1, servers=server_lines(ports, ["r1", "r2"]))
        async with supervised(settings, text) as sup:
            clients = [await KeepAliveClient(front).connect() for _ in range(3)]
            try:
                first = sup.current_pid

                async def r2_down() -> bool:
                    answer = await sup.cli.on(first, "show servers state app")
                    return any(s.name == "r2" and s.down for s in parse_servers_state(answer))

                await sup.until(r2_down, what="r2 DOWN in the first worker")
                await asyncio.sleep(0.3)  # a poll reads the first worker's view
                for client in clients:
                    assert (await client.get())[:2] == (200, "r1")
                await sup.reload(text.replace("backend app\n", "backend app\n    # generation 2\n"))
                started["r2"].start()
                node = vanish(Env(sup, front, ports, started, first, clients, 500, 1), "r1")
                try:
                    await sup.until(lambda: "app/r1" in sup.state.old_workers[first].steered, what="r1 steered")
                    assert await sup.map_of(first) == {"app_0": "fallback", "app_n": "1"}
                    got = await answers(clients, rounds=2)
                    assert got and all(a[:2] == (200, "fallback") and a[2] < 0.25 for a in got), got
                finally:
                    node.close()
            finally:
                for client in clients:
                    await client.close()


async def test_many_changed_targets_replace_the_whole_map_at_once(rundir):
    """Past REPLACE_ABOVE changed entries, a worker's map is swapped with prepare/commit."""
    backends_count = 80

    def many(ports: dict[str, int]) -> str:
        head = server_lines(ports, ["r1", "r2"])
        extra = "".join(f"\nbackend b{i}\n{server_lines(ports, ['r1', 'r2'])}" for i in range(backends_count))
        return head + extra

    async with old_worker(rundir, many, clients=2) as env:
        sup = env.sup
        for i in range(backends_count):
            sup.displaced.mark_dead(f"b{i}/r1")
        sup.displaced.mark_dead("app/r1")  # stays steered: only a whole replacement sends it again
        steady = {"app_0": "r2", "app_n": "2"}
        first = {
            **{f"b{i}_0": "r2" for i in range(backends_count)},
            **{f"b{i}_n": "2" for i in range(backends_count)},
            **steady,
        }

        async def map_is(expected: dict[str, str]) -> bool:
            return await sup.map_of(env.old_pid) == expected

        await sup.until(lambda: map_is(first), what="first steering")
        for i in range(backends_count):
            sup.displaced.unmark_dead(f"b{i}/r1")
            sup.displaced.mark_dead(f"b{i}/r2")
        # slot 0 (r1) is usable again and slot 1 (r2) is overridden: 80 entries go, 80 come
        second = {
            **{f"b{i}_1": "r1" for i in range(backends_count)},
            **{f"b{i}_n": "2" for i in range(backends_count)},
            **steady,
        }
        await sup.until(lambda: map_is(second), what="second steering")
        # 80 `del map` commands would be needed: the whole map (162 entries) went in one committed version
        assert sup.displaced.last_push["changes"] == 2 * backends_count + len(steady)
        assert sup.state.old_workers[env.old_pid].push.state == "ok"
        assert sup.state.push_failures == 0


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
            await sup.restart_displaced()
            await sup.until(lambda: old_pid in sup.state.old_workers, what="old worker listed")
            await asyncio.sleep(0.5)  # the new component's first rounds: maps read, states read
            before = counting.show_procs
            await asyncio.sleep(3.0)  # 30 polls
            assert counting.show_procs - before <= 3, counting.show_procs - before  # every 2 s
            await client.close()
            started_at = time.monotonic()
            await sup.until(lambda: old_pid not in sup.state.old_workers, timeout=5, what="old worker gone")
            assert time.monotonic() - started_at < 1.0  # not waiting for the next listing
