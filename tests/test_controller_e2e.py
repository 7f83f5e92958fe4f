"""Controller-socket mode end to end: the daemon (a subprocess) owns HAProxy, and the lines
haproxytech's ingress controller writes (tests/support/controller.py) are replayed through
its sockets under keep-alive load.

The control sends the same lines straight to HAProxy's stats socket: the controller's
address-first disable shows the 503 `SC` window there.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from supervisor.haproxy.answers import ProcList
from tests.support.controller import add_map_payload, disable, enable, sync_line, wrap
from tests.support.daemon import Daemon
from tests.support.harness import Backend, KeepAliveClient, backends, free_port
from tests.test_runtime_e2e import LogReceiver

pytestmark = pytest.mark.haproxy

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


async def roundtrip(path: Path, data: bytes, timeout: float = 30) -> bytes:
    """What the controller's client does: one line on a fresh connection, read until EOF."""
    async with asyncio.timeout(timeout):
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


STEPS = 1500  # more lines than the control ever needed for its first 503 (figures in the commit)
PAUSE_S = 0.002
# The control sends lines until the first 503.
CONTROL_MAX_LINES, CONTROL_MAX_S = 3000, 60


async def test_rolling_deployment_through_the_relay_gives_no_503(rundir):
    """Slots disabled and enabled through the relay, a map updated, and a reload through the
    facade halfway, as the controller does them, under keep-alive load."""
    async with sidecar(rundir) as s:
        first = rolling_lines(s, STEPS // 2)
        halfway = s.rendered()  # the config the controller writes for the slots it runs by then
        second = rolling_lines(s, STEPS - STEPS // 2)
        answers: list[bytes] = []
        reloaded = b""

        async def work() -> None:
            nonlocal reloaded
            answers.extend(await replay(s.runtime_socket, first, pause_s=PAUSE_S))
            answers.extend(await update_map(s, "/ halfway"))
            s.daemon.write(halfway)
            reloaded = await reload_through_facade(s)
            answers.extend(await replay(s.runtime_socket, second, pause_s=PAUSE_S))

        load = await under_load(s.front, work)
        await asyncio.sleep(0.1)
        failed = s.failed_lines()
        states = await s.servers_state()
        assert s.daemon.count("sent in a safe order") == STEPS
    assert reloaded.startswith(b"Success=1\n--\n"), reloaded
    assert load.statuses[503] == 0 and not failed, (load.statuses, failed[:3])
    assert set(load.statuses) == {200} and load.requests > 500, load.statuses
    assert all(controller_accepts(a) for a in answers), answers[:3]
    assert all(a.startswith(b"\n") for a in answers), answers[:3]  # set severity-output's answer first
    for name, pod in s.slots.items():
        assert states[name] == ((pod.address, "ready") if pod else ("127.0.0.1:1", "maint")), states


async def test_control_the_same_lines_straight_to_haproxy_give_503_sc(rundir):
    """The window between the two commands of a disable is narrow: the lines go round until
    HAProxy logs a failed request, bounded in count and in time."""
    async with sidecar(rundir) as s:
        sent = 0

        async def work() -> None:
            nonlocal sent
            deadline = time.monotonic() + CONTROL_MAX_S
            while sent < CONTROL_MAX_LINES and time.monotonic() < deadline and not s.failed_lines():
                await replay(s.stats_socket, rolling_lines(s, 20), pause_s=PAUSE_S)
                sent += 20

        load = await under_load(s.front, work)
        await asyncio.sleep(0.1)
        failed = s.failed_lines()
    assert load.statuses[503] > 0, f"the controller's order should show the window: {load.statuses}, {sent} lines"
    assert failed and all(" SC-- " in line for line in failed), failed[:3]


async def test_answers_read_as_haproxy_gives_them_in_the_controller_order(rundir):
    """The relay's answer to a reordered line is HAProxy's answer to the line as written."""
    async with sidecar(rundir) as s:
        # An unknown server first: its error is what client-native's check reads.
        line = wrap(b"set server b/NOPE addr 127.0.0.1 port 1;" + disable("b", "SRV_1", port=1))
        via_relay = await roundtrip(s.runtime_socket, line)
        await roundtrip(s.stats_socket, wrap(enable("b", "SRV_1", "127.0.0.1", s.pods[0].port)))
        straight = await roundtrip(s.stats_socket, line)
        assert s.daemon.count("sent in a safe order") == 1
    assert via_relay == straight, (via_relay, straight)
    assert via_relay.startswith(b"\n[3]: No such server.\n"), via_relay
    assert not controller_accepts(via_relay)


async def test_map_update_passes_byte_for_byte(rundir):
    async with sidecar(rundir) as s:
        prepared = await roundtrip(s.runtime_socket, wrap(f"prepare map {s.map_path}".encode()))
        m = re.search(rb"New version created: (\d+)", prepared)
        assert m, prepared
        version = m[1].decode()
        added = await roundtrip(s.runtime_socket, add_map_payload(version, str(s.map_path), "/ new\n/a alpha"))
        committed = await roundtrip(s.runtime_socket, wrap(f"commit map @{version} {s.map_path}".encode()))
        shown = (await roundtrip(s.stats_socket, f"show map {s.map_path}\n".encode())).decode()
        client = await KeepAliveClient(s.front).connect()
        try:
            status, _, _ = await client.get("/a")
        finally:
            await client.close()
        assert s.daemon.count("sent in a safe order") == 0
    assert (added, committed) == (b"\n\n", b"\n\n"), (added, committed)
    assert re.findall(r"\S+ (\S+ \S+)", shown) == ["/ new", "/a alpha"], shown
    assert status == 200


async def test_out_of_service_marks_the_server_dead_for_old_workers(rundir):
    async with sidecar(rundir, {"old_workers": {"guard": True}}) as s:
        status_sock = s.daemon.directory / "status.sock"

        async def operator_dead() -> str:
            reader, writer = await asyncio.open_unix_connection(str(status_sock))
            writer.write(b"GET /status HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n")
            answer = (await reader.read()).decode()
            writer.close()
            return answer

        await roundtrip(s.runtime_socket, sync_line(disable("b", "SRV_1", port=1)))
        marked = await operator_dead()
        await roundtrip(s.runtime_socket, sync_line(enable("b", "SRV_1", "127.0.0.1", s.pods[0].port)))
        unmarked = await operator_dead()
    assert "b/SRV_1" in marked, marked[-2000:]
    assert "b/SRV_1" not in unmarked, unmarked[-2000:]


# ---------------------------------------------------------------- the master socket facade


def pid_of(procs: ProcList) -> int:
    worker = procs.current_worker
    assert worker is not None, procs
    return worker.pid


async def reload_through_facade(s: Sidecar) -> bytes:
    return await roundtrip(s.master_socket, b"reload;quit\n", timeout=60)


async def test_reload_through_the_facade_runs_the_daemons_cycle(rundir):
    # The watcher would apply each write only after 10 s: what happens next is the facade's doing.
    async with sidecar(rundir, {"reload": {"runtime_apply": True, "debounce_ms": 10000, "max_delay_ms": 20000}}) as s:
        before = await s.daemon.show_proc()
        # A slot filled: servers only, so the cycle applies it at runtime, in the same worker.
        s.slots["SRV_3"] = s.pods[2]
        s.daemon.write(s.rendered())
        applied = await reload_through_facade(s)
        middle = await s.daemon.show_proc()
        states = await s.servers_state()
        # A line beyond servers: the cycle reloads.
        s.daemon.write(s.rendered().replace("    retries 1\n", "    retries 2\n"))
        reloaded = await reload_through_facade(s)
        after = await s.daemon.show_proc()
        # other commands on the line: answered by the master, in their place
        listed_then_reloaded = await roundtrip(s.master_socket, b"show proc;reload;quit\n", timeout=20)
        helped = await roundtrip(s.master_socket, b"set severity-output number;help;quit\n")
        info = await roundtrip(s.master_socket, b"@1 set severity-output number;@1 show info;quit\n")
        log = s.daemon.run_log()
    assert applied.startswith(b"Success=1\n--\n") and b"applied at runtime" in applied, f"{applied!r}\n{log}"
    assert pid_of(middle) == pid_of(before), "a change of servers only is no reload"
    assert states["SRV_3"] == (s.pods[2].address, "ready"), states
    assert reloaded.startswith(b"Success=1\n--\n") and b"reloaded" in reloaded, reloaded
    assert pid_of(after) != pid_of(before)
    assert b"[ALERT]" not in applied + reloaded
    assert listed_then_reloaded.startswith(b"#") and b"\nSuccess=1\n--\n" in listed_then_reloaded, listed_then_reloaded
    assert "controller master socket" in log
    assert b"help" in helped and b"show proc" in helped, helped[:300]  # the master's own list
    assert re.search(rb"\nVersion: \d+\.\d+", info), info[:200]


async def test_refused_config_answers_success_0_with_haproxys_alerts(rundir):
    async with sidecar(rundir) as s:
        before = await s.daemon.show_proc()
        s.daemon.write(s.rendered().replace("    balance roundrobin", "    balance roundrobin\n    bogus_keyword"))
        answer = await reload_through_facade(s)
        after = await s.daemon.show_proc()
        client = await KeepAliveClient(s.front).connect()
        try:
            status, _, _ = await client.get()
        finally:
            await client.close()
    assert answer.startswith(b"Success=0\n--\n"), answer
    assert re.search(rb"\[ALERT\].*bogus_keyword", answer), answer
    assert pid_of(after) == pid_of(before)
    assert status == 200  # the last good config serves


async def test_facade_and_relay_answer_within_a_second_of_a_daemon_restart(rundir):
    async with sidecar(rundir) as s:
        s.daemon.signal(signal.SIGQUIT)  # the daemon exits, HAProxy stays for the next one to adopt
        assert await s.daemon.wait_exit() == 3
        s.daemon.start()
        started = time.monotonic()
        deadline = started + 5
        while True:
            try:
                info = await roundtrip(s.master_socket, b"@1 set severity-output number;@1 show info;quit\n", 5)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline, "the facade did not come back"
                await asyncio.sleep(0.02)
        answered_s = time.monotonic() - started
        disabled = await roundtrip(s.runtime_socket, sync_line(disable("b", "SRV_1", port=1)))
        s.slots["SRV_1"] = None  # the controller writes its config as it runs it, then reloads
        s.daemon.write(s.rendered())
        answer = await reload_through_facade(s)
        states = await s.servers_state()
        log = s.daemon.run_log()
    # Bound before HAProxy is adopted; the time includes the interpreter's start on a shared host.
    assert log.index("controller master socket") < log.index("haproxy-supervisor starting"), log[-2000:]
    assert answered_s < 3.0, answered_s
    assert re.search(rb"\nVersion: \d+\.\d+", info), info[:200]
    assert controller_accepts(disabled), disabled
    assert answer.startswith(b"Success=1\n--\n"), answer
    assert states["SRV_1"] == ("127.0.0.1:1", "maint"), states
