"""Fault: `status.listen` is taken by another process when the daemon starts.

The daemon used to run on without a status API (retrying every 5 s), and still said READY=1 to
systemd: nothing could see what it did. Now `run` stops with exit 2 and one line naming
status.listen, before READY=1; an HAProxy it would adopt is left serving, untouched.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.support.faults import serving

pytestmark = pytest.mark.haproxy


def notify_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    return sock


def received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(65536).decode())
        except BlockingIOError:
            return out


async def test_a_status_listener_that_cannot_bind_stops_run_before_ready(make, rundir: Path):
    async with serving(make) as node:
        d = node.daemon
        master = d.master_pid()
        d.signal(signal.SIGQUIT)  # the daemon goes, HAProxy stays to be adopted
        assert await d.wait_exit() == 3
        # Another process listens on the status socket now.
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squatter.bind(str(d.directory / "status.sock"))
        squatter.listen(1)
        notify = notify_socket(rundir / "notify.sock")
        try:
            d.start(env={"NOTIFY_SOCKET": str(rundir / "notify.sock")})
            started = time.monotonic()
            code = await d.wait_exit(timeout=20)
            took = time.monotonic() - started
            await asyncio.sleep(0.5)  # the loop goes on through the untouched HAProxy
            messages = received(notify)
            procs = await d.show_proc()
        finally:
            notify.close()
            squatter.close()
    lines = [line for line in d.run_log().splitlines() if not line.startswith("---")]
    print(f"exit {code} after {took:.2f}s: {lines}")
    assert code == 2, d.run_log()
    assert len(lines) == 1 and "status.listen" in lines[0] and "status.sock" in lines[0], lines
    assert not any("READY=1" in m for m in messages), messages
    assert procs.master is not None and procs.master.pid == master, "HAProxy untouched"
    assert not node.loop.failures, node.loop.failures[:5]
    assert set(node.tags()) == {"v1"}
