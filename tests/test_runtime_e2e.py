"""End to end with the real HAProxy: runtime server changes, their order, and server state
across reloads.

The controls show each failure the module prevents on the binary the tests run: a ready
server re-addressed to the placeholder answers 503 (SC in the log), a rolling deployment
driven address-first gives 503s under load, a maint server comes back UP after a reload
without the state file, and HAProxy's own state-file rules keep a stale port or a stale
maint that the filter drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from supervisor.effective import build_effective, prepare_runtime_dir, write_effective
from supervisor.haproxy.answers import ServerState, parse_servers_state, parse_show_proc
from supervisor.haproxy.api import MasterCLI
from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime import RuntimeApplier
from supervisor.haproxy.runtime.apply import apply_changes
from supervisor.haproxy.runtime.changes import ServerChange
from supervisor.settings import HAProxySettings, OldWorkerSettings, ReloadSettings, Settings
from supervisor.state import Generation, utcnow
from tests.support.harness import Backend, HAProxyMaster, KeepAliveClient, backends, free_port
from tests.support.wholes import plan_runtime_apply

pytestmark = pytest.mark.haproxy

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

    def drain(self) -> list[str]:
        while True:
            try:
                self.lines.append(self.sock.recv(65536).decode(errors="replace"))
            except BlockingIOError:
                return self.lines

    def close(self) -> None:
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
        outcome = await self.applier(self.generation, new_model, effective)
        if not outcome.applied:
            return False
        write_effective(self.settings.haproxy.effective_config, effective)
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
        write_effective(self.settings.haproxy.effective_config, effective)
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


# ---------------------------------------------------------------- control: the window is real


TWO_SERVERS = """
backend app
    balance roundrobin
    server s1 {s1}
    server s2 {s2}
"""


async def test_control_readdressed_ready_server_answers_503_with_sc(rundir):
    with pods(2) as (p1, p2):
        async with running_rig(rundir, TWO_SERVERS, s1=p1.address, s2=p2.address) as rig:
            answer = rig.master.command(f"@!{rig.worker} set server app/s1 addr 127.0.0.1 port 1")
            assert "port changed from" in answer, answer
            statuses = Counter()
            for _ in range(6):  # roundrobin: every other request is balanced to s1
                client = await KeepAliveClient(rig.front).connect()
                status, _, _ = await client.get(timeout=5)
                statuses[status] += 1
                await client.close()
            await asyncio.sleep(0.1)
            lines = failed_log_lines(rig)
    assert statuses[503] >= 2 and statuses[200] >= 2, statuses
    assert lines, "no 503 logged"
    for line in lines:
        # server s1, connect time -1, termination SC, 3 retries on the same server
        assert " app/s1 " in line and " SC-- " in line and "/-1/" in line and "/3 " in line, line


async def test_maint_first_disable_of_the_same_server_loses_nothing(rundir):
    with pods(2) as (p1, p2):
        async with running_rig(rundir, TWO_SERVERS, s1=p1.address, s2=p2.address) as rig:
            disable = ServerChange("app", "s1", "127.0.0.1", p1.port, "127.0.0.1", 1, enabled=False)
            result = await apply_changes(rig.cli, rig.worker, [disable])
            assert result.ok and result.applied == [disable], result
            statuses = Counter()
            for _ in range(6):
                client = await KeepAliveClient(rig.front).connect()
                status, body, _ = await client.get(timeout=5)
                statuses[(status, body)] += 1
                await client.close()
            state = rig.servers()["s1"]
    assert statuses == Counter({(200, "pod1"): 6}), statuses
    assert state.in_maint and state.port == 1


# ---------------------------------------------------------------- rolling deployment through template slots

GROUPS = 6  # server-template lines of 2 slots each
LIVE = 3  # lines in service at any time
STEPS = 100  # each: one line (2 slots) disabled, one (2 slots) enabled -> 200 disables, 200 enables


def rolling_body(assignment: list[int | None]) -> str:
    lines = ["", "backend app", "    balance roundrobin"]
    for i, port in enumerate(assignment, start=1):
        where = f"127.0.0.1:{port}" if port is not None else f"{PLACEHOLDER} disabled"
        lines.append(f"    server-template g{i}_ 1-2 {where} check inter 300ms")
    return "\n".join(lines) + "\n"


def initial_assignment(ports: list[int]) -> list[int | None]:
    return [ports[i % len(ports)] if i < LIVE else None for i in range(GROUPS)]


def rolling_deployment(ports: list[int], steps: int = STEPS) -> Iterator[list[int | None]]:
    """Assignments of backend ports to template lines: oldest out, a parked line in, each step."""
    assignment = initial_assignment(ports)
    live = list(range(LIVE))
    parked = list(range(LIVE, GROUPS))
    for step in range(steps):
        out, into = live.pop(0), parked.pop(0)
        assignment[out] = None
        assignment[into] = ports[step % len(ports)]
        live.append(into)
        parked.append(out)
        yield list(assignment)


def addr_first(change: ServerChange) -> list[str]:
    """The order that opens the window (test only): address, then the state, as two commands."""
    target = f"{change.backend}/{change.server}"
    commands = []
    if change.address_changed:
        commands.append(f"set server {target} addr {change.to_address} port {change.to_port}")
    if change.was_enabled and not change.enabled:
        commands.append(f"set server {target} state maint")
    elif change.enabled and not change.was_enabled:
        commands.append(f"set server {target} state ready")
    return commands


async def roll(rig: Rig, ports: list[int], apply) -> int:
    slot_changes = 0
    for assignment in rolling_deployment(ports):
        slot_changes += await apply(rolling_body(assignment))
        await asyncio.sleep(0.005)  # traffic flows between steps, as between controller updates
    return slot_changes


def check_final_state(rig: Rig, ports: list[int]) -> None:
    final = list(rolling_deployment(ports))[-1]
    servers = rig.servers()
    for i, port in enumerate(final, start=1):
        for slot in (f"g{i}_1", f"g{i}_2"):
            s = servers[slot]
            if port is None:
                assert s.in_maint and s.port == 1, (slot, s)
            else:
                assert not s.in_maint and s.port == port, (slot, s)


async def test_rolling_deployment_through_slots_without_a_503_or_a_reload(rundir):
    with pods(4) as started:
        ports = [p.port for p in started]
        async with running_rig(rundir, rolling_body(initial_assignment(ports))) as rig:
            reloads, worker = rig.reloads(), rig.worker
            applied_slot_changes = 0

            async def apply(body: str) -> int:
                before = rig.applier.last_result
                assert await rig.apply_rendered(rendered_of(rig, body))
                result = rig.applier.last_result
                assert result is not before and result is not None and result.ok
                return len(result.applied)

            async def work() -> None:
                nonlocal applied_slot_changes
                applied_slot_changes = await roll(rig, ports, apply)

            load = await under_load(rig, work)
            assert applied_slot_changes == 4 * STEPS  # 2 slots out, 2 slots in, each step
            assert rig.reloads() == reloads and rig.worker == worker, "runtime apply must not reload"
            check_final_state(rig, ports)
            assert rig.settings.haproxy.effective_config.read_text() == build_effective(
                rig.settings, rendered_of(rig, rolling_body(list(rolling_deployment(ports))[-1]))
            ).text
            lines = failed_log_lines(rig)
    assert load.statuses[503] == 0 and not lines, (load.statuses, lines[:5])
    assert set(load.statuses) == {200} and load.requests > 500, load.statuses


async def test_control_rolling_deployment_address_first_gives_503s(rundir):
    with pods(4) as started:
        ports = [p.port for p in started]
        async with running_rig(rundir, rolling_body(initial_assignment(ports))) as rig:

            async def apply(body: str) -> int:
                new = Config.parse(build_effective(rig.settings, rendered_of(rig, body)).text)
                changes = plan_runtime_apply(rig.generation.model, new)
                assert changes is not None
                result = await apply_changes(rig.cli, rig.worker, changes, order=addr_first)
                assert result.ok, result.refused
                rig.generation = replace(rig.generation, model=new)
                return len(result.applied)

            async def work() -> None:
                await roll(rig, ports, apply)

            load = await under_load(rig, work)
            check_final_state(rig, ports)
            await asyncio.sleep(0.1)
            lines = failed_log_lines(rig)
    assert load.statuses[503] > 0, f"address-first should show the window: {load.statuses}"
    assert lines and all(" SC-- " in line for line in lines), (load.statuses, rig.logs.lines[:5])


# ---------------------------------------------------------------- server state across reloads

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


@pytest.mark.parametrize("preserve", [True, False], ids=["with-state-file", "control-without"])
async def test_maint_server_stays_in_maint_across_a_reload(rundir, preserve):
    with pods(2) as (p1, p2):
        body = STATEFUL
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, body, preserve_state=preserve, **fmt) as rig:
            # An operator's maint: nothing in the config says so.
            assert rig.master.command(f"@!{rig.worker} set server app/s2 state maint").strip() == ""
            old = rig.worker
            new = await rig.reload_rendered(rendered_of(rig, body, **fmt))
            assert new != old
            s2 = rig.servers(new)["s2"]
            seen = await bodies_of(rig.front, 8)
    if preserve:
        assert s2.in_maint, s2
        assert seen == Counter({(200, "pod0"): 8}), seen
    else:
        assert not s2.in_maint, "control: without the state file the new worker brings s2 back"
        assert seen[(200, "pod1")] > 0, seen


async def test_slots_parked_at_runtime_stay_parked_across_a_reload_and_come_back(rundir):
    with pods(3) as (p1, p2, p3):
        fmt = dict(s1=p1.address, s2=p2.address, slot=p3.address)
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            parked = dict(fmt, slot=f"{PLACEHOLDER} disabled")
            assert await rig.apply_rendered(rendered_of(rig, STATEFUL, **parked))
            # Another change needs a reload; the slots stay parked.
            reload_body = STATEFUL.replace("balance roundrobin", "balance leastconn")
            new = await rig.reload_rendered(rendered_of(rig, reload_body, **parked))
            slots = [rig.servers(new)[f"slot{i}"] for i in (1, 2)]
            assert all(s.in_maint and s.port == 1 for s in slots), slots
            assert (await bodies_of(rig.front, 6))[(200, "pod2")] == 0
            # Filled again at runtime in the new worker: they serve.
            assert await rig.apply_rendered(rendered_of(rig, reload_body, **fmt))
            slots = [rig.servers(new)[f"slot{i}"] for i in (1, 2)]
            assert all(not s.in_maint and s.port == p3.port for s in slots), slots
            seen = await bodies_of(rig.front, 12)
    assert seen[(200, "pod2")] > 0 and sum(n for (status, _), n in seen.items() if status != 200) == 0, seen


@pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "control-raw-state"])
async def test_reload_takes_addresses_and_enables_from_the_new_config(rundir, filtered):
    """HAProxy's own rules would keep a stale port and the maint this daemon set at runtime."""
    with pods(4) as (p1, p2, p3, p4):
        fmt = dict(s1=p1.address, s2=p2.address, slot=p3.address)
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            # The daemon parks the slots at runtime (forced maint in this worker) ...
            assert await rig.apply_rendered(rendered_of(rig, STATEFUL, **dict(fmt, slot=f"{PLACEHOLDER} disabled")))
            # ... then the next config fills them again at the same address, moves s1 to
            # another port, and changes something that needs a reload.
            body = STATEFUL.replace("balance roundrobin", "balance leastconn")
            moved = dict(fmt, s1=p4.address, s2=p2.address.replace("127.0.0.1", "127.0.0.2"))
            new = await rig.reload_rendered(rendered_of(rig, body, **moved), raw_state=not filtered)
            servers = rig.servers(new)
    s1, s2, slot1 = servers["s1"], servers["s2"], servers["slot1"]
    # An address written as an IP literal comes from the config either way.
    assert s2.address == "127.0.0.2" and s2.port == p2.port, s2
    if filtered:
        assert s1.port == p4.port, s1
        assert not slot1.in_maint, slot1
    else:
        assert s1.port == p1.port, "control: HAProxy takes srv_port from the state file over the config"
        assert slot1.in_maint, "control: HAProxy keeps the forced maint although the config enables the slot"


# ---------------------------------------------------------------- refused commands


async def test_unknown_server_is_refused_and_others_still_apply(rundir, caplog):
    caplog.set_level(logging.WARNING, logger="supervisor.haproxy.runtime")
    with pods(3) as (p1, p2, p3):
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            ghost = ServerChange("app", "ghost", "127.0.0.1", 1, "127.0.0.1", p3.port, was_enabled=False)
            slot = ServerChange("app", "slot1", "127.0.0.1", 1, "127.0.0.1", p3.port, was_enabled=False)
            result = await apply_changes(rig.cli, rig.worker, [ghost, slot])
            servers = rig.servers()
    assert result.applied == [slot] and [r.change for r in result.refused] == [ghost]
    refused = result.refused[0]
    assert refused.command == "set server app/ghost state maint" and refused.answer == "No such server."
    assert not refused.left_in_maint
    assert not servers["slot1"].in_maint and servers["slot1"].port == p3.port
    assert any("app/ghost" in r.getMessage() and "No such server." in r.getMessage() for r in caplog.records)


async def test_refusal_mid_sequence_leaves_the_server_in_maint(rundir, caplog):
    """A static balance algorithm refuses the weight: `state ready` is never sent."""
    caplog.set_level(logging.WARNING, logger="supervisor.haproxy.runtime")
    body = STATEFUL.replace("balance roundrobin", "balance source")
    with pods(3) as (p1, p2, p3):
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, body, **fmt) as rig:
            enable = ServerChange(
                "app", "slot1", "127.0.0.1", 1, "127.0.0.1", p3.port, to_weight=50, was_enabled=False
            )
            hostname = ServerChange("app", "s2", "127.0.0.1", p2.port, "nosuch.invalid", 80)
            result = await apply_changes(rig.cli, rig.worker, [enable, hostname])
            servers = rig.servers()
            seen = await bodies_of(rig.front, 10)
    assert result.applied == [] and len(result.refused) == 2
    weight, addr = result.refused
    assert weight.command == "set server app/slot1 weight 50" and "static LB algorithm" in weight.answer
    assert weight.left_in_maint and servers["slot1"].in_maint and servers["slot1"].port == p3.port
    assert addr.command == "set server app/s2 addr nosuch.invalid port 80" and "Invalid addr" in addr.answer
    # A live server's address is swapped in place (make before break): refused, it serves on as it was.
    assert not addr.left_in_maint and not servers["s2"].in_maint and servers["s2"].port == p2.port
    assert sum(seen.values()) == 10 and set(seen) <= {(200, "pod0"), (200, "pod1")}, seen
    messages = [r.getMessage() for r in caplog.records]
    assert any("app/slot1" in m and "left in maint" in m for m in messages), messages


async def test_old_worker_refuses_and_the_hook_asks_for_a_reload(rundir, caplog):
    caplog.set_level(logging.WARNING, logger="supervisor.haproxy.runtime")
    with pods(3) as (p1, p2, p3):
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            old = rig.worker
            slow = await KeepAliveClient(rig.front).connect()
            try:
                in_flight = asyncio.create_task(slow.get("/slow?ms=3000", timeout=10))
                await asyncio.sleep(0.2)
                new = rig.master.reload()
                assert old in rig.master.worker_pids()[1], "the first worker should be draining"
                # A generation that still points at the old worker, as after a missed reload.
                enable = rendered_of(rig, STATEFUL, **dict(fmt, slot=p3.address))
                applied = await rig.apply_rendered(enable)
                result = rig.applier.last_result
                old_slot = rig.servers(old)["slot1"]
                new_slot = rig.servers(new)["slot1"]
                await in_flight
            finally:
                await slow.close()
    assert applied is False and result is not None and len(result.refused) == 2
    assert {r.answer for r in result.refused} == {"Proxy is disabled."}
    assert {r.command.split()[-1] for r in result.refused} == {"maint"}  # nothing after the refused maint
    assert rig.applier.forget == {"app/slot1", "app/slot2"}
    assert old_slot.in_maint and old_slot.port == 1 and new_slot.in_maint and new_slot.port == 1
    assert sum("Proxy is disabled." in r.getMessage() for r in caplog.records) == 2


async def test_hook_answers_false_for_a_change_that_needs_a_reload(rundir):
    with pods(2) as (p1, p2):
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            before = rig.generation.model.render()
            # A parameter `set server` cannot set (servers added or removed: test_membership_e2e).
            changed = STATEFUL.replace("    server s2 {s2} check", "    server s2 {s2} maxconn 10 check")
            assert not await rig.apply_rendered(rendered_of(rig, changed, **fmt))
            assert rig.generation.model.render() == before and rig.applier.last_result is None
            # Comments only: nothing to do, no reload either.
            assert await rig.apply_rendered(rendered_of(rig, STATEFUL + "# regenerated\n", **fmt))
            assert rig.applier.last_result is None
