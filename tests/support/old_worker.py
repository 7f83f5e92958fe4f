"""An old worker held on purpose against the real HAProxy, for the OldWorkers end-to-end tests:
a config of slots from a template, a supervised master whose first worker keeps a client and
becomes old at a reload, its answers through the master CLI, and a node that vanishes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from rigs.harness import Backend, KeepAliveClient, VanishedNode, backends, free_port
from rigs.supervised import Supervised, supervised
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings

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
