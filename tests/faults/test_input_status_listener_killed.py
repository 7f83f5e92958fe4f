"""Fault: the status listener's listening socket is destroyed under the daemon (`ss -K`, as a
conntrack flush or an operator's mistake can), issue 32.

The daemon used to spin at a whole core: the destroyed socket stays readable and every
accept() fails with EINVAL, each logged with a traceback (46 MB of log in 10 s), while
/healthz never answered again and systemd's watchdog was still fed. Now the dead listener
is noticed at its first failed accept(), logged once and bound again with a backoff; while
it cannot be bound no WATCHDOG=1 is sent.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rigs.daemon import RequestLoop, tagged_config
from rigs.harness import backends, free_port
from supervisor.status.listener import quiet_loop_errors
from tests.support.faults import FAST_CONVERGE, cpu_seconds, serving, tcp_request

pytestmark = pytest.mark.haproxy

HEALTHZ_AGAIN_S = 10.0  # issue 32: /healthz answers again within this long
MAX_CPU_SHARE = 0.20  # of one core, over the window after the kill
MAX_LOG_BYTES = 1 << 20
WINDOW_S = 5.0


def destroy_listener(port: int) -> None:
    done = subprocess.run(
        ["ss", "-K", "-t", "-l", "src", "127.0.0.1", "sport", "=", f":{port}"],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"ss -K cannot destroy sockets here: {done.stderr.strip()}")
    if f":{port}" not in done.stdout:
        pytest.skip(f"ss -K found no listener to destroy (a kernel without CONFIG_INET_DIAG_DESTROY?): {done.stdout}")


async def healthz(port: int) -> int | None:
    try:
        code, _ = await tcp_request(port, "/healthz", timeout=1.0)
    except (OSError, TimeoutError):
        return None
    return code


async def wait_healthz(port: int, timeout: float) -> float:
    started = time.monotonic()
    while await healthz(port) != 200:
        if time.monotonic() - started > timeout:
            raise AssertionError(f"/healthz did not answer 200 within {timeout}s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


def settings(port: int) -> dict:
    return {**FAST_CONVERGE, "status": {"listen": f"127.0.0.1:{port}"}}


async def test_a_destroyed_listener_is_bound_again_without_spinning(make):
    port = free_port()
    async with serving(make, settings(port), settled_s=None) as node:
        d = node.daemon
        assert await healthz(port) == 200
        log_before = d.log_path.stat().st_size
        cpu_before, wall_before = cpu_seconds(d.pid), time.monotonic()
        destroy_listener(port)
        again_s = -1.0
        try:
            again_s = await wait_healthz(port, HEALTHZ_AGAIN_S)
        finally:
            await asyncio.sleep(max(0.0, WINDOW_S - (time.monotonic() - wall_before)))
            cpu_share = (cpu_seconds(d.pid) - cpu_before) / (time.monotonic() - wall_before)
            log_bytes = d.log_path.stat().st_size - log_before
            print(f"/healthz again after {again_s:.2f}s; "
                  f"cpu {cpu_share:.1%} of a core over {WINDOW_S}s; log +{log_bytes} bytes")
        assert d.proc is not None and d.proc.poll() is None, "the daemon stays up"
    log = d.run_log()
    assert cpu_share < MAX_CPU_SHARE, (cpu_share, log[-3000:])
    assert log_bytes < MAX_LOG_BYTES, log_bytes
    assert "Traceback" not in log, log[-3000:]
    assert d.count(r"status: status.listen .*: accept\(\) fails") == 1, log[-3000:]
    assert d.count(r"status: listening on .* again") == 1, log[-3000:]
    assert not node.loop.failures, node.loop.failures[:5]


def notify_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    return sock


def pings(sock: socket.socket) -> int:
    count = 0
    while True:
        try:
            count += sock.recv(65536).count(b"WATCHDOG=1")
        except BlockingIOError:
            return count


async def test_a_listener_that_cannot_be_bound_again_starves_the_watchdog(make, rundir: Path):
    """Another process takes the port before the daemon can bind it again: the daemon retries
    with a backoff, logs that rate-limited, sends no WATCHDOG=1 meanwhile (systemd would
    restart it), and serves again once the port is free."""
    port = free_port()
    front = free_port()
    notify = notify_socket(rundir / "notify.sock")
    squatter: socket.socket | None = None
    try:
        with backends("b1") as started:
            d = make(tagged_config(front, started["b1"].address, "v1"), settings(port))
            # A watchdog of 0.4 s: a ping every 0.2 s.
            d.start(env={"NOTIFY_SOCKET": str(rundir / "notify.sock"), "WATCHDOG_USEC": "400000"})
            await d.wait_generation(1)
            await wait_healthz(port, 15)
            loop = RequestLoop(front, max_requests=4000, max_seconds=40).start()
            await asyncio.sleep(0.5)
            assert pings(notify) >= 2, "the watchdog is fed while all is well"
            d.signal(signal.SIGSTOP)  # so that the squatter binds first
            try:
                destroy_listener(port)
                squatter = socket.socket()
                # The destroyed socket still holds its port until the daemon closes it.
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                squatter.bind(("127.0.0.1", port))
                squatter.listen(1)
            finally:
                d.signal(signal.SIGCONT)
            await d.wait_log(r"cannot bind again", timeout=5)
            pings(notify)
            cpu_before, wall_before = cpu_seconds(d.pid), time.monotonic()
            await asyncio.sleep(3.0)
            starved = pings(notify)
            cpu_share = (cpu_seconds(d.pid) - cpu_before) / (time.monotonic() - wall_before)
            squatter.close()
            squatter = None
            again_s = await wait_healthz(port, HEALTHZ_AGAIN_S)
            await asyncio.sleep(0.6)
            fed_again = pings(notify)
            results = await loop.stop()
            print(f"pings while the port was taken: {starved}; after: {fed_again}; cpu {cpu_share:.1%}; "
                  f"/healthz again {again_s:.2f}s after the port was free; {len(results)} requests")
            d.cleanup()
    finally:
        notify.close()
        if squatter is not None:
            squatter.close()
    assert not loop.failures, loop.failures[:5]
    log = d.run_log()
    assert starved == 0, log[-3000:]
    assert fed_again >= 1, log[-3000:]
    assert cpu_share < MAX_CPU_SHARE, cpu_share
    assert d.count(r"cannot bind again") <= 2, log[-3000:]  # the first, then once a minute
    assert d.count(r"systemd watchdog: no WATCHDOG=1 while status.listen") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


async def test_an_error_repeating_in_the_event_loop_makes_one_traceback(caplog):
    """The rule behind the fix: whatever fails again and again in a callback (the destroyed
    socket made 1,758 tracebacks in 10 s here on main) is logged in full once, then at most
    once a minute."""
    loop = asyncio.get_running_loop()

    def failing() -> None:
        raise OSError(22, "Invalid argument")

    restore = quiet_loop_errors(loop)
    try:
        for _ in range(500):
            loop.call_soon(failing)
        await asyncio.sleep(0.05)
    finally:
        restore()
    tracebacks = [r for r in caplog.records if r.exc_info]
    lines = [r for r in caplog.records if "Invalid argument" in r.getMessage() or r.exc_info]
    assert len(tracebacks) == 1, len(tracebacks)
    assert len(lines) == 2, [r.getMessage() for r in lines]  # the traceback, then one "again" line
