"""OldWorkers against the real HAProxy: ending streams stuck on a dead server, and the targets a
steered request goes to when they die, are down in the old worker, or change all at once."""

from __future__ import annotations

import asyncio

import pytest

from rigs.harness import KeepAliveClient, backends, free_port
from rigs.supervised import supervised
from supervisor.haproxy.answers import parse_servers_state
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings
from tests.support.old_worker import TEMPLATE, Env, answers, old_worker, server_lines, vanish

pytestmark = pytest.mark.haproxy


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
                    return any(s.name == "r2" and s.op_state == 0 for s in parse_servers_state(answer))

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
        assert sup.displaced.rounds.last_push["changes"] == 2 * backends_count + len(steady)
        assert sup.state.old_workers[env.old_pid].push.state == "ok"
        assert sup.state.push_failures == 0
