"""The daemon (a subprocess) in controller-socket mode, as a sidecar to haproxytech's ingress
controller, for its end-to-end tests: the config the controller renders, the daemon with its
relay and master-socket facade in front of real pods, keep-alive load, and the controller's
lines (rigs/controller.py) replayed through its sockets."""

from __future__ import annotations

import asyncio
import contextlib
import re
import resource
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rigs.controller import add_map_payload, disable, enable, sync_line, wrap
from rigs.daemon import Daemon
from rigs.harness import Backend, KeepAliveClient, backends, free_port
from rigs.runtime_rig import LogReceiver
from supervisor.controller.connections import connect_unix

SLOTS = 4

CONFIG = """\
global
    hard-stop-after 30s
    stats socket {stats} mode 600 level admin

defaults
    mode http
    # Long enough that a live pod on a busy host never times out: a retry after a timeout
    # would go to whatever address the slot has by then.
    timeout connect 2s
    timeout client 10s
    timeout server 10s
    retries 1
    # After a reload the old worker answers the next request on each idle keep-alive
    # connection, with `connection: close`, instead of closing it under the client.
    option idle-close-on-response

frontend fe
    bind 127.0.0.1:{front}
    log {log} local0
    option httplog
    option dontlog-normal
    http-request set-var(txn.route) path,map({map},none)
    http-response set-header x-route %[var(txn.route)]
    default_backend b

backend b
    balance roundrobin
{servers}
"""


@dataclass
class Load:
    statuses: Counter = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())


async def keep_alive_load(port: int, stop: asyncio.Event, load: Load, clients: int = 4,
                          max_requests: int = 100_000, max_seconds: float = 90) -> None:
    """Keep-alive clients back to back on loopback, bounded in count and in time."""
    deadline = time.monotonic() + max_seconds

    async def one() -> None:
        client = await KeepAliveClient(port).connect()
        try:
            while not stop.is_set() and load.requests < max_requests and time.monotonic() < deadline:
                status, _, _ = await client.get(timeout=5)
                load.statuses[status] += 1
                if status != 200 or client.closing:
                    await client.close()
                    client = await KeepAliveClient(port).connect()
        finally:
            await client.close()

    async with asyncio.TaskGroup() as group:
        for _ in range(clients):
            group.create_task(one())


async def under_load(front: int, work: Callable[[], Awaitable[None]]) -> Load:
    load, stop = Load(), asyncio.Event()
    runner = asyncio.create_task(keep_alive_load(front, stop, load))
    try:
        deadline = time.monotonic() + 10
        while load.statuses[200] < 50:
            assert time.monotonic() < deadline and not runner.done(), f"load did not warm up: {load.statuses}"
            await asyncio.sleep(0.02)
        await work()
        await asyncio.sleep(0.2)
    finally:
        stop.set()
        await runner
    return load


async def roundtrip(path: Path, data: bytes, timeout: float = 30, *, retry_full_queue: bool = False) -> bytes:
    """What the controller's client does: one line on a fresh connection, read until EOF.
    `retry_full_queue`: a client that waits while the socket's queue is full (EAGAIN) instead of
    taking the socket asyncio hands back unconnected."""
    async with asyncio.timeout(timeout):
        if retry_full_queue:
            reader, writer = await connect_unix(path, timeout)
        else:
            reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(data)
            await writer.drain()
            return await reader.read()
        finally:
            writer.close()


@dataclass
class Sidecar:
    daemon: Daemon
    front: int
    pods: list[Backend]
    logs: LogReceiver
    map_path: Path
    runtime_socket: Path  # the controller's: the daemon's relay
    master_socket: Path  # the controller's: the daemon's facade
    slots: dict[str, Backend | None] = field(default_factory=dict)  # SRV_i -> the pod it points at

    @property
    def stats_socket(self) -> Path:
        """HAProxy's own runtime socket (the daemon's path in runtime_dir)."""
        return self.daemon.runtime / "stats.sock"

    def rendered(self) -> str:
        lines = []
        for name, pod in self.slots.items():
            lines.append(f"    server {name} {pod.address}" if pod else f"    server {name} 127.0.0.1:1 disabled")
        return CONFIG.format(
            stats=self.runtime_socket,  # where the controller writes it: the daemon moves it
            front=self.front, log=self.logs.path, map=self.map_path, servers="\n".join(lines),
        )

    def failed_lines(self) -> list[str]:
        return [line for line in self.logs.drain() if " 503 " in line]

    async def servers_state(self) -> dict[str, tuple[str, str]]:
        """SRV_i -> (address:port, admin state) as the current worker has them."""
        answer = (await roundtrip(self.stats_socket, b"show servers state b\n")).decode()
        states = {}
        for row in answer.splitlines()[2:]:
            words = row.split()
            if len(words) > 18:
                states[words[3]] = (f"{words[4]}:{words[18]}", "maint" if int(words[6]) & 1 else "ready")
        return states


@contextlib.asynccontextmanager
async def sidecar(rundir: Path, settings: dict | None = None) -> AsyncIterator[Sidecar]:
    with backends(*(f"pod{i}" for i in range(SLOTS))) as started:
        pods = list(started.values())
        map_path = rundir / "paths.map"
        map_path.write_text("/ root\n")
        logs = LogReceiver(rundir / "log.sock")
        base = {"controller": {"runtime_socket": str(rundir / "haproxy-runtime-api.sock"),
                               "master_socket": str(rundir / "haproxy-master.sock")},
                "haproxy": {"move_stats_socket": True}}
        for key, value in (settings or {}).items():
            base.setdefault(key, {}).update(value)
        daemon = Daemon(rundir / "d", "", base)
        s = Sidecar(daemon, free_port(), pods, logs, map_path,
                    rundir / "haproxy-runtime-api.sock", rundir / "haproxy-master.sock")
        s.slots = {f"SRV_{i + 1}": pods[i] if i < 2 else None for i in range(SLOTS)}
        daemon.write(s.rendered())
        try:
            daemon.start()
            await daemon.wait_generation(1)
            yield s
        finally:
            daemon.cleanup()
            logs.close()


def rolling_lines(s: Sidecar, steps: int) -> list[bytes]:
    """The controller's lines for a rolling deployment over the slots: each step a new pod takes
    a free slot (address, then ready) and an old one leaves its slot (address, then maint), on
    one SyncBackendSrvs line. `s.slots` follows along."""
    lines = []
    for _ in range(steps):
        free = next(name for name, pod in s.slots.items() if pod is None)
        leaving = next(name for name, pod in s.slots.items() if pod is not None)
        serving = {pod.name for pod in s.slots.values() if pod is not None}
        arriving = next(p for p in s.pods if p.name not in serving)
        s.slots[free], s.slots[leaving] = arriving, None
        pairs = {free: enable("b", free, "127.0.0.1", arriving.port), leaving: disable("b", leaving, port=1)}
        lines.append(sync_line(*(pairs[name] for name in sorted(pairs))))
    return lines


async def replay(path: Path, lines: list[bytes], pause_s: float = 0.01) -> list[bytes]:
    answers = []
    for line in lines:
        answers.append(await roundtrip(path, line))
        await asyncio.sleep(pause_s)
    return answers


def controller_accepts(answer: bytes) -> bool:
    """client-native's check: no `[0]:` .. `[3]:` right after the severity-output answer."""
    return answer[1:5] not in (b"[0]:", b"[1]:", b"[2]:", b"[3]:")


async def update_map(s: Sidecar, payload: str) -> list[bytes]:
    """The controller's SetMapContent through the relay: prepare, add with a payload, commit."""
    prepared = await roundtrip(s.runtime_socket, wrap(f"prepare map {s.map_path}".encode()))
    m = re.search(rb"New version created: (\d+)", prepared)
    assert m, prepared
    version = m[1].decode()
    added = await roundtrip(s.runtime_socket, add_map_payload(version, str(s.map_path), payload))
    committed = await roundtrip(s.runtime_socket, wrap(f"commit map @{version} {s.map_path}".encode()))
    return [prepared, added, committed]


async def reload_through_facade(s: Sidecar) -> bytes:
    return await roundtrip(s.master_socket, b"reload;quit\n", timeout=60)


def raise_fd_limit(wanted: int) -> None:
    """Enough descriptors for `wanted` connections at once (each caller holds one, the relay
    two per caller in flight)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


@dataclass
class Callers:
    """What simultaneous callers got: an answer each (None: the connection failed, `errors`
    says how), and how long each waited for it."""

    answers: list[bytes | None]
    errors: Counter
    latencies_ms: list[float]

    @property
    def lost(self) -> int:
        """Lines that got no answer from HAProxy: the connection failed, or the relay answered
        in HAProxy's place (`[3]: haproxy-supervisor: ...`)."""
        return sum(1 for a in self.answers if a is None or b"haproxy-supervisor" in a)


async def simultaneous(path: Path, lines: list[bytes], timeout: float = 60, retrying: bool = False) -> Callers:
    """Every line on its own connection, all at once, as many callers (the Data Plane API, an
    operator's socat, scrapers and the controller) sharing one socket. `retrying`: callers
    that wait out a full queue."""
    start = asyncio.Event()
    errors: Counter = Counter()
    latencies: list[float] = []

    async def one(line: bytes) -> bytes | None:
        await start.wait()
        began = time.monotonic()
        try:
            answer = await roundtrip(path, line, timeout, retry_full_queue=retrying)
        except (OSError, TimeoutError) as exc:
            errors[type(exc).__name__ + (f" {exc.strerror}" if isinstance(exc, OSError) else "")] += 1
            return None
        latencies.append((time.monotonic() - began) * 1000)
        return answer

    tasks = [asyncio.create_task(one(line)) for line in lines]
    await asyncio.sleep(0)
    start.set()
    answers = await asyncio.gather(*tasks)
    return Callers(list(answers), errors, latencies)
