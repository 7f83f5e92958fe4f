"""The drain incident, staged with real HAProxy, for the end-to-end tests and bench/drain.py.

A Ray Serve-shaped config: app `echo` (1 replica) and `highscale` (2) live only on the node
that gets drained, `wide` has 1 of its 3 replicas there, and every backend has a `fallback`
backup. Clients hold keep-alive connections to the worker of each generation; the replicas
move, HAProxy reloads, and the drained node vanishes (connects hang). Whoever uses
`staged_drain` then sends requests on the connections the old workers hold.

Who reloads is a parameter (`supervise`): the daemon's reloader and steering in this process
(rigs/supervised.py), the real daemon (`daemon_supervised`), or plain HAProxy with
or without the observe directive (`plain_haproxy`). Everything listens on 127.0.0.1; every
process is stopped by PID on the way out.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigs.daemon import DaemonSupervised, daemons
from rigs.harness import HAProxyMaster, KeepAliveClient, VanishedNode, backends, free_port
from supervisor.haproxy.config import Config, inject_observe
from supervisor.settings import Settings

APPS = ("echo", "highscale", "wide")
DRAINED = ("echo_r1", "highscale_r1", "highscale_r2", "wide_r1")  # all on the node being drained
SURVIVORS = ("wide_r2", "wide_r3", "fallback")
MOVED = ("echo_r2", "highscale_r3", "highscale_r4", "wide_r4")  # where the drained replicas went

HEAD = """\
global
    hard-stop-after 120s
    # Old workers keep their connections and keep taking requests on them; with a window
    # HAProxy would close each at a random moment in it (see tests/support/old_worker.py).
    close-spread-time infinite

defaults
    mode http
    timeout connect {connect_ms}ms
    timeout client 30s
    timeout server 30s
    timeout http-keep-alive 30s
    option idle-close-on-response
    retries {retries}
    option redispatch
    balance leastconn

frontend http_frontend
    bind 127.0.0.1:{front}
    acl is_echo path_beg /echo
    acl is_highscale path_beg /highscale
    acl is_wide path_beg /wide
    use_backend echo if is_echo
    use_backend highscale if is_highscale
    use_backend wide if is_wide
"""

BEFORE = {"echo": ["echo_r1"], "highscale": ["highscale_r1", "highscale_r2"], "wide": ["wide_r1", "wide_r2", "wide_r3"]}
AFTER = {"echo": ["echo_r2"], "highscale": ["highscale_r3", "highscale_r4"], "wide": ["wide_r4", "wide_r2", "wide_r3"]}


@dataclass(frozen=True)
class Shape:
    """The knobs of the rendered config that decide how long a request to a vanished server waits."""

    connect_timeout_s: float = 0.5
    retries: int = 2

    def rendered(self, front: int, ports: dict[str, int], servers: dict[str, list[str]], tag: str = "") -> str:
        """A rendered config with `servers[app]` as the app's primaries and `fallback` as backup.
        A name `x@p` is server x served by backend process p. `tag` goes into a response
        header: a line beyond the servers, so that a change between two configs is a reload
        (servers alone are added and removed at runtime, and leave no old worker)."""
        text = HEAD.format(front=front, connect_ms=int(self.connect_timeout_s * 1000), retries=self.retries)
        if tag:
            text += f"    http-response set-header x-config {tag}\n"
        for app in APPS:
            text += f"\nbackend {app}\n"
            for name in servers[app]:
                process = name.split("@")[-1]
                text += f"    server {name.split('@')[0]} 127.0.0.1:{ports[process]} check inter 300ms\n"
            text += f"    server fallback 127.0.0.1:{ports['fallback']} check inter 300ms backup\n"
        return text


def intermediate(k: int) -> dict[str, list[str]]:
    """Generation k before the drain: the same replicas, plus one more for `wide` (served by
    wide_r3's process), so every generation runs a config of its own."""
    servers = {app: list(names) for app, names in BEFORE.items()}
    servers["wide"] += [f"wide_extra{i}@wide_r3" for i in range(2, k + 1)]
    return servers


@dataclass
class Drain:
    """The moment after the drain: old workers hold `held`, the drained node has vanished."""

    sup: Any  # a Supervised, DaemonSupervised or PlainHAProxy
    front: int
    held: dict[tuple[int, str], list[KeepAliveClient]]  # (generation, app) -> connections
    old_pids: list[int]  # oldest first: generation g's worker is old_pids[g - 1]


Supervise = Callable[[Settings, str], contextlib.AbstractAsyncContextManager[Any]]


@contextlib.asynccontextmanager
async def staged_drain(
    settings: Settings, supervise: Supervise, generations: int, clients_per_app: int, shape: Shape = Shape(),
) -> AsyncIterator[Drain]:
    """Start the backends and `supervise`d HAProxy, make `generations` old workers each holding
    `clients_per_app` kept-alive connections per app (each with a first good answer), move the
    replicas with a reload, make the drained node vanish, and hand over."""
    front = free_port()
    with backends(*DRAINED, *SURVIVORS, *MOVED) as started:
        ports = {name: b.port for name, b in started.items()}
        held: dict[tuple[int, str], list[KeepAliveClient]] = {}
        keepers: list[KeepAliveClient] = []
        vanished: list[VanishedNode] = []
        async with supervise(settings, shape.rendered(front, ports, intermediate(1), "g1")) as sup:
            try:
                old_pids = []
                for generation in range(1, generations + 1):
                    for app in APPS:
                        held[generation, app] = [await KeepAliveClient(front).connect() for _ in range(clients_per_app)]
                        for client in held[generation, app]:
                            status, body, _ = await client.get(f"/{app}")
                            if status != 200:
                                raise RuntimeError(f"/{app} before the drain answered {status} {body!r}")
                    # A request that fails on connect closes its connection: this idle one keeps
                    # the old worker alive until the end, whatever happens to the others.
                    keepers.append(await KeepAliveClient(front).connect())
                    old_pids.append(sup.current_pid)
                    if generation < generations:
                        next_config = shape.rendered(front, ports, intermediate(generation + 1), f"g{generation + 1}")
                        await sup.reload(next_config)
                # The replicas move: a new rendered config, and a reload.
                await sup.reload(shape.rendered(front, ports, AFTER, "after"))
                still_old = sorted(sup.master.worker_pids()[1])
                if still_old != sorted(old_pids):
                    raise RuntimeError(f"old workers {still_old}, expected {sorted(old_pids)}")
                # The drained node vanishes.
                for name in DRAINED:
                    started[name].stop()
                    vanished.append(VanishedNode(ports[name]))
                if not all(node.connect_hangs() for node in vanished):
                    raise RuntimeError("connects to the vanished node do not hang")
                yield Drain(sup, front, held, old_pids)
            finally:
                for client in [*keepers, *(c for cs in held.values() for c in cs)]:
                    await client.close()
                for node in vanished:
                    node.close()


@contextlib.asynccontextmanager
async def daemon_supervised(settings: Settings, rendered_text: str) -> AsyncIterator[DaemonSupervised]:
    """`haproxy-supervisor run` as a subprocess, with the settings that matter here."""
    with daemons(settings.haproxy.runtime_dir) as make:
        daemon = make(rendered_text, {
            "old_workers": {"guard": settings.old_workers.guard, "poll_interval_ms": 100},
            "reload": {"runtime_apply": True},
        })
        daemon.start()
        await daemon.wait_generation(1)
        yield DaemonSupervised(daemon)


class PlainHAProxy:
    """HAProxy in master-worker mode reloaded on the master CLI, as a fleet without the daemon
    does it; `transform` is applied to every rendered config (the identity, or an injection)."""

    def __init__(self, master: HAProxyMaster, transform: Callable[[str], str]) -> None:
        self.master = master
        self.transform = transform

    @property
    def current_pid(self) -> int:
        pid, _ = self.master.worker_pids()
        if pid is None:
            raise RuntimeError("no current worker")
        return pid

    async def reload(self, rendered: str) -> int:
        self.master.config.write_text(self.transform(rendered))
        return self.master.reload()


def with_observe(error_limit: int) -> Callable[[str], str]:
    """The rendered config with `observe layer4 error-limit N on-error mark-down` on every
    checked server: Ray Serve's own fix, as the daemon injects it when the env gate is set."""
    return lambda rendered: inject_observe(Config.parse(rendered), error_limit).render()


def plain_haproxy(transform: Callable[[str], str] = str) -> Supervise:
    @contextlib.asynccontextmanager
    async def supervise(settings: Settings, rendered_text: str) -> AsyncIterator[PlainHAProxy]:
        runtime = Path(settings.haproxy.runtime_dir)
        runtime.mkdir(parents=True, exist_ok=True)
        config = runtime / "haproxy.cfg"
        config.write_text(transform(rendered_text))
        master = HAProxyMaster(config, runtime).start()
        try:
            yield PlainHAProxy(master, transform)
        finally:
            master.stop()

    return supervise
