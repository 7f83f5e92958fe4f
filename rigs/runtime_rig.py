"""A real HAProxy master driven the way the daemon drives it, for the runtime end-to-end tests:
the rig (master, CLI, current generation) on a config with a logging frontend, the log receiver
that collects failed requests, keep-alive load under which changes apply, and the daemon
applying changes under that load; and the config with state (two servers and a parked slot)
that the tests of refusals and of state across reloads share."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from rigs.harness import Backend, HAProxyMaster, KeepAliveClient, backends, free_port
from supervisor.effective import build_effective, prepare_runtime_dir, write_slot_table
from supervisor.files import write_atomically
from supervisor.haproxy.answers import ServerState, parse_servers_state, parse_show_proc
from supervisor.haproxy.api import MasterCLI
from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.hook import RuntimeApplier
from supervisor.settings import HAProxySettings, OldWorkerSettings, ReloadSettings, Settings
from supervisor.state import Generation, utcnow

PLACEHOLDER = "127.0.0.1:1"

# Only the frontend logs, and only failed requests: server state changes (hundreds in a
# rolling deployment) would otherwise fill the datagram queue and push request lines out.
HEAD = """\
global
    maxconn 1000

defaults
    mode http
    timeout connect 200ms
    timeout client 5s
    timeout server 5s
    retries 3

frontend fe
    bind 127.0.0.1:{front}
    log {log_socket} local0
    option httplog
    option dontlog-normal
    default_backend app
"""


class LogReceiver:
    """The unix datagram socket HAProxy logs to; with `dontlog-normal` only failures arrive."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.lines: list[str] = []
        self._closed = False
        self._reader: threading.Thread | None = None

    def drain(self) -> list[str]:
        while True:
            try:
                self.lines.append(self.sock.recv(65536).decode(errors="replace"))
            except BlockingIOError:
                return self.lines

    def follow(self) -> LogReceiver:
        """Read in a thread as lines arrive: a unix datagram queue holds only
        net.unix.max_dgram_qlen (10) messages, and HAProxy drops what does not fit."""
        def read() -> None:
            with contextlib.suppress(OSError):
                while True:
                    ready, _, _ = select.select([self.sock], [], [], 0.2)
                    if self._closed:
                        return
                    if ready:
                        self.drain()
        self._closed = False
        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        return self

    def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.join(2)
            self.drain()
        self.sock.close()


@dataclass
class Rig:
    """A master running the effective config of a rendered one, as the daemon would run it."""

    rundir: Path
    settings: Settings
    master: HAProxyMaster
    cli: MasterCLI
    logs: LogReceiver
    front: int
    generation: Generation
    applier: RuntimeApplier = field(init=False)

    def __post_init__(self) -> None:
        self.applier = RuntimeApplier(self.cli)

    @property
    def worker(self) -> int:
        pid = self.master.worker_pids()[0]
        assert pid is not None
        return pid

    def reloads(self) -> int:
        procs = parse_show_proc(self.master.command("show proc"))
        assert procs.master is not None
        return procs.master.reloads

    def servers(self, pid: int | None = None) -> dict[str, ServerState]:
        answer = self.master.command(f"@!{pid or self.worker} show servers state app")
        return {s.name: s for s in parse_servers_state(answer)}

    async def apply_rendered(self, rendered: str) -> bool:
        """What the reloader does with the runtime_apply hook: apply, then write and adopt the config."""
        effective = build_effective(self.settings, rendered)
        new_model = Config.parse(effective.text)
        outcome = await self.applier(self.generation, new_model)
        if not outcome.applied:
            return False
        write_slot_table(effective.slot_table)
        write_atomically(self.settings.haproxy.effective_config, effective.text)
        self.generation = replace(self.generation, model=outcome.runs or new_model,
                                  effective_sha256=effective.sha256, rendered_sha256=effective.rendered_sha256)
        return True

    async def reload_rendered(self, rendered: str, *, raw_state: bool = False) -> int:
        """What the reloader does for a reload: save the state, write the config, reload."""
        effective = build_effective(self.settings, rendered)
        new_model = Config.parse(effective.text)
        path = self.settings.haproxy.server_state_file
        if raw_state:
            # Control: the state as HAProxy dumps it, without the filter.
            path.write_text(self.master.command(f"@!{self.worker} show servers state"))
        elif self.settings.reload.preserve_server_state:
            assert await self.applier.save_server_state(self.generation, new_model, path)
        write_slot_table(effective.slot_table)
        write_atomically(self.settings.haproxy.effective_config, effective.text)
        pid = self.master.reload()
        self.generation = Generation(
            self.generation.number + 1, new_model, effective.sha256, effective.rendered_sha256, utcnow(), pid
        )
        return pid


@contextlib.asynccontextmanager
async def running_rig(
    rundir: Path, rendered_body: str, *, preserve_state: bool = True, **fmt: object
) -> AsyncIterator[Rig]:
    front = free_port()
    log_socket = rundir / "log.sock"
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir),
        reload=ReloadSettings(preserve_server_state=preserve_state),
        old_workers=OldWorkerSettings(guard=False),
    )
    prepare_runtime_dir(settings)
    rendered = HEAD.format(log_socket=log_socket, front=front) + rendered_body.format(**fmt)
    effective = build_effective(settings, rendered)
    settings.haproxy.effective_config.write_text(effective.text)
    logs = LogReceiver(log_socket)
    master = HAProxyMaster(settings.haproxy.effective_config, rundir)
    try:
        master.start()
        pid = master.worker_pids()[0]
        generation = Generation(1, Config.parse(effective.text), effective.sha256, effective.rendered_sha256,
                                utcnow(), pid)
        yield Rig(rundir, settings, master, MasterCLI(master.socket), logs, front, generation)
    finally:
        master.stop()
        logs.close()


def rendered_of(rig: Rig, body: str, **fmt: object) -> str:
    return HEAD.format(log_socket=rig.logs.path, front=rig.front) + body.format(**fmt)


@dataclass
class Load:
    statuses: Counter = field(default_factory=Counter)
    bodies: Counter = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())


async def steady_load(
    port: int, stop: asyncio.Event, load: Load, clients: int = 4, max_requests: int = 60_000, max_seconds: float = 60
) -> None:
    """Keep-alive clients in a loop on loopback, bounded in count and in time."""
    deadline = time.monotonic() + max_seconds

    async def one() -> None:
        client = await KeepAliveClient(port).connect()
        try:
            while not stop.is_set() and load.requests < max_requests and time.monotonic() < deadline:
                status, body, _ = await client.get(timeout=5)
                load.statuses[status] += 1
                load.bodies[body] += 1
                if status != 200:
                    await client.close()
                    client = await KeepAliveClient(port).connect()
        finally:
            await client.close()

    async with asyncio.TaskGroup() as group:
        for _ in range(clients):
            group.create_task(one())


async def under_load(rig: Rig, work, clients: int = 4, max_requests: int = 60_000) -> Load:
    """Run `work()` while clients hammer the frontend; the load starts warm and stops after."""
    load = Load()
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(steady_load(rig.front, stop, load, clients=clients, max_requests=max_requests))
        try:
            await wait_async(lambda: load.statuses[200] >= 50, what="load warm-up")
            await work()
            await asyncio.sleep(0.2)
        finally:
            stop.set()
    return load


async def daemon_applies_under_load(
    daemon, front: int, texts: Iterable[str], interval_s: float = 0.0, max_requests: int = 60_000
) -> Load:
    """Write each rendered text and wait for the daemon to apply it at runtime (`reload
    runtime_applied`), while 4 keep-alive clients load the frontend from before the first
    write (warm) to after the last."""
    load, stop = Load(), asyncio.Event()
    runner = asyncio.create_task(steady_load(front, stop, load, clients=4, max_requests=max_requests, max_seconds=90))
    try:
        await wait_async(lambda: load.statuses[200] >= 50, what="load warm-up")
        for step, text in enumerate(texts, start=1):
            daemon.write(text)
            await daemon.wait_log(r"reload runtime_applied", count=step, timeout=10)
            await asyncio.sleep(interval_s)
        await asyncio.sleep(0.2)
    finally:
        stop.set()
        await runner
    return load


async def wait_async(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def pods(count: int) -> Iterator[list[Backend]]:
    with backends(*(f"pod{i}" for i in range(count))) as started:
        yield list(started.values())


def failed_log_lines(rig: Rig, status: str = "503") -> list[str]:
    return [line for line in rig.logs.drain() if f" {status} " in line]


STATEFUL = """
backend app
    balance roundrobin
    server s1 {s1} check inter 300ms
    server s2 {s2} check inter 300ms
    server-template slot 1-2 {slot} check inter 300ms
"""


async def bodies_of(port: int, count: int) -> Counter:
    seen = Counter()
    client = await KeepAliveClient(port).connect()
    try:
        for _ in range(count):
            status, body, _ = await client.get(timeout=5)
            seen[(status, body)] += 1
    finally:
        await client.close()
    return seen
