"""End to end, the daemon as a subprocess against the real HAProxy: its own life and HAProxy's.

Adoption after kill -9, HAProxy's master dying, SIGTERM, systemd notify, old_workers.max.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from rigs.daemon import http_get, one_backend
from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port

pytestmark = pytest.mark.haproxy


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive after {timeout}s"
        await asyncio.sleep(0.05)


async def test_kill9_of_the_daemon_then_run_again_adopts_without_dropping_anything(make):
    async with one_backend(make) as node:
        d, front, b1, worker = node.daemon, node.front, node.backend, node.worker
        master = d.master_pid()
        assert master is not None
        loop = node.requests(max_requests=5000, max_seconds=25)
        slow = asyncio.get_running_loop().create_task(http_get(front, "/slow?ms=2500", timeout=10))
        await asyncio.sleep(0.3)

        d.kill9()
        assert alive(master), "HAProxy must outlive the daemon"
        # While no daemon watches, the rendered config changes: the next daemon must notice.
        d.write(config(front, b1, "v2"))
        await asyncio.sleep(0.3)
        d.start()
        lines = await d.wait_log(r"master adopted pid=\d+")
        assert f"master adopted pid={master} worker={worker}" in lines[0]
        await d.wait_log(r"generations rebuilt current=1 ")
        await d.wait_log(r"reload ok generation=2")
        assert d.count(r"starting haproxy master") == 0, "a second HAProxy was started"

        status, headers, body = await slow
        assert (status, headers.get("x-tag"), body) == (200, "v1", "b1"), "the in-flight request was dropped"
        await asyncio.sleep(0.3)
        results = await loop.stop()
        assert d.master_pid() == master
        procs = await d.show_proc()
        assert procs.master is not None and procs.master.pid == master
    assert len(results) > 20 and not loop.failures, (len(results), loop.failures[:5])
    assert results[-1][1] == "v2"
    index = json.loads((d.runtime / "generations.json").read_text())
    assert index["current_generation"] == 2
    assert (d.runtime / "generations" / "2.cfg").read_text() == (d.runtime / "haproxy.cfg").read_text()


async def test_adoption_rebuilds_old_worker_generations(make):
    """An old worker still draining when the daemon dies keeps its generation after adoption."""
    async with one_backend(make) as node:
        d, front, b1, w1 = node.daemon, node.front, node.backend, node.worker
        # Long enough to outlast a daemon restart on a loaded machine: w1 must still be draining.
        slow = asyncio.get_running_loop().create_task(http_get(front, "/slow?ms=8000", timeout=20))
        await asyncio.sleep(0.2)
        d.write(config(front, b1, "v2"))
        w2 = await d.wait_generation(2)
        d.kill9()
        d.start()
        lines = await d.wait_log(r"generations rebuilt")
        assert "current=2" in lines[0] and "kept=[1, 2]" in lines[0], lines
        index = json.loads((d.runtime / "generations.json").read_text())
        assert index["workers"][str(w1)]["generation"] == 1
        assert index["workers"][str(w2)]["generation"] == 2
        assert (await slow)[0] == 200
        # Once the old worker has finished its request and left, its generation is pruned.
        await d.wait_log(rf"generation pruned generation=1 worker={w1}")
        assert not (d.runtime / "generations" / "1.cfg").exists()


async def test_a_killed_master_is_started_again_and_traffic_resumes(make):
    async with one_backend(make) as node:
        d, front = node.daemon, node.front
        first = d.master_pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        lines = await d.wait_log(r"master exited pid=\d+")
        assert f"pid={first} (killed by SIGKILL)" in lines[0]
        await d.wait_log(r"master restart in 0s restarts=1")  # the first death after a start: at once
        await d.wait_generation(2)
        second = d.master_pid()
        assert second is not None and second != first
        d.remember_master()
        deadline = time.monotonic() + 5
        while (answer := await http_get(front))[0] != 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert answer[0] == 200 and answer[1].get("x-tag") == "v1"
        # Changes still go through on the new master.
        node.write("v2")
        await d.wait_log(r"reload ok generation=3")
        assert (await http_get(front))[1].get("x-tag") == "v2"


async def test_sigterm_stops_haproxy_gracefully_and_exits_0(make):
    async with one_backend(make) as node:
        d, front, worker = node.daemon, node.front, node.worker
        master = d.master_pid()
        assert master is not None
        slow = asyncio.get_running_loop().create_task(http_get(front, "/slow?ms=1000", timeout=10))
        await asyncio.sleep(0.2)
        d.signal(signal.SIGTERM)
        assert await d.wait_exit() == 0
        # Soft-stop: the in-flight request finished before HAProxy went away.
        assert (await slow)[0] == 200
        assert not alive(master) and not alive(worker)
        assert not (d.runtime / "haproxy.pid").exists()
        assert d.count(r"soft-stop \(SIGUSR1\)") == 1 and d.count(r"hard-stop") == 0
        assert await http_get(front, timeout=1) == (0, {}, "")


async def test_sigterm_hard_stops_after_stop_timeout(make):
    async with one_backend(make, {"haproxy": {"stop_timeout_s": 0.5}}) as node:
        d, front = node.daemon, node.front
        master = d.master_pid()
        assert master is not None
        slow = asyncio.get_running_loop().create_task(http_get(front, "/slow?ms=5000", timeout=10))
        await asyncio.sleep(0.2)
        began = time.monotonic()
        d.signal(signal.SIGTERM)
        assert await d.wait_exit() == 0
        assert time.monotonic() - began < 4
        assert d.count(r"hard-stop \(SIGTERM\)") == 1
        assert (await slow)[0] == 0, "the slow request cannot have finished: HAProxy was hard-stopped"
        assert not alive(master)


async def test_notify_messages_on_a_real_socket(make, rundir: Path):
    front = free_port()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = rundir / "notify.sock"
    sock.bind(str(path))
    sock.setblocking(False)
    messages: list[dict[str, str]] = []

    def drain() -> None:
        while True:
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                return
            messages.append(dict(line.split("=", 1) for line in data.decode().split("\n")))

    async def wait_for(pred, timeout: float = 10) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            drain()
            found = [m for m in messages if pred(m)]
            if found:
                return found[-1]
            assert time.monotonic() < deadline, messages
            await asyncio.sleep(0.05)

    try:
        with backends("b1") as started:
            d = make(config(front, started["b1"].address, "v1"))
            d.start(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"})
            ready = await wait_for(lambda m: m.get("READY") == "1")
            worker = await d.wait_generation(1)
            assert ready["STATUS"].startswith(f"generation 1 worker {worker}")
            # HAProxy must not inherit our notify socket.
            master = d.master_pid()
            assert master is not None and "NOTIFY_SOCKET" not in psutil.Process(master).environ()

            before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            d.signal(signal.SIGHUP)
            reloading = await wait_for(lambda m: m.get("RELOADING") == "1")
            assert before <= int(reloading["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            worker2 = await d.wait_generation(2)
            after = await wait_for(lambda m: m.get("READY") == "1" and f"worker {worker2}" in m.get("STATUS", ""))
            assert "reloads ok 1" in after["STATUS"]
            assert messages.index(reloading) < messages.index(after)

            drain()
            pings = sum(1 for m in messages if m.get("WATCHDOG") == "1")
            await asyncio.sleep(1.0)
            drain()
            # WATCHDOG_USEC=0.4 s: a ping every 0.2 s, about 5 in a second.
            assert sum(1 for m in messages if m.get("WATCHDOG") == "1") - pings >= 3

            d.signal(signal.SIGTERM)
            assert await d.wait_exit() == 0
            await wait_for(lambda m: m.get("STOPPING") == "1")
    finally:
        sock.close()


async def test_old_workers_over_max_get_sigterm_oldest_first(make):
    async with one_backend(make, {"old_workers": {"max": 1}}) as node:
        d, front, b1, w1 = node.daemon, node.front, node.backend, node.worker
        loop = asyncio.get_running_loop()
        # A slow request in flight keeps each worker alive after it is replaced.
        held1 = loop.create_task(http_get(front, "/slow?ms=8000", timeout=15))
        await asyncio.sleep(0.2)
        d.write(config(front, b1, "v2"))
        w2 = await d.wait_generation(2)
        held2 = loop.create_task(http_get(front, "/slow?ms=3000", timeout=15))
        await asyncio.sleep(0.2)
        procs = await d.show_proc()
        assert [p.pid for p in procs.old_workers] == [w1], "one old worker is within the limit"
        d.write(config(front, b1, "v3"))
        await d.wait_generation(3)
        lines = await d.wait_log(r"old worker pid=\d+ generation=\d+ SIGTERM")
        assert f"old worker pid={w1} generation=1 SIGTERM: 2 old workers alive > old_workers.max=1" in lines[0]
        await wait_gone(w1)
        assert alive(w2), "only the oldest goes"
        assert (await held1)[0] == 0, "the oldest worker was hard-stopped with its request"
        assert (await held2)[0] == 200
        assert d.count(rf"old worker pid={w2} ") == 0


async def test_sigquit_detaches_and_the_next_run_adopts(make):
    """How the daemon alone is restarted or upgraded: exit 3, HAProxy untouched, adopted again."""
    async with one_backend(make) as node:
        d, front, worker = node.daemon, node.front, node.worker
        master = d.master_pid()
        assert master is not None
        d.signal(signal.SIGQUIT)
        assert await d.wait_exit() == 3
        assert alive(master) and alive(worker)
        assert (await http_get(front))[0] == 200
        d.start()
        await d.wait_log(rf"master adopted pid={master} worker={worker}")
        d.signal(signal.SIGTERM)
        assert await d.wait_exit() == 0
        assert not alive(master)


_CHILD_THREADS = """
import asyncio, sys, threading
from supervisor.daemon import watch_children_without_threads
if sys.argv[1] == "pidfd":
    watch_children_without_threads()
async def main():
    proc = await asyncio.create_subprocess_exec("sleep", "0.2")
    threads = threading.active_count()
    await proc.wait()
    print(threads, proc.returncode)
asyncio.run(main())
"""


@pytest.mark.parametrize("watcher", ["pidfd", "default"])
def test_the_daemon_waits_for_its_children_without_a_thread_each(watcher: str):
    """`haproxy -c` runs on every change: Python 3.11's default watcher starts a thread for
    each child (the control), the daemon's waits in the event loop."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _CHILD_THREADS, watcher], capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()
    threads, code = int(out[0]), int(out[1])
    assert code == 0
    if sys.version_info < (3, 12):
        assert threads == (1 if watcher == "pidfd" else 2), threads
