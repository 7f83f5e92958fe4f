"""Fault: HAProxy's master dies while runtime_dir is full (issue 32).

The daemon used to exit 1 on the ENOSPC of clearing the server-state file before starting a
master, and said "haproxy is left running" while none ran: HAProxy stayed down as long as the
disk stayed full. The files a master start writes are best-effort: a write that fails is
reported in /status and as a metric, and HAProxy starts without it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rigs.daemon import Daemon, RequestLoop, http_get
from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port
from tests.support.faults import FAST_CONVERGE, fill, metrics, status, tmpfs, wait_converged

pytestmark = pytest.mark.haproxy

SERVING_AGAIN_S = 3.0  # issue 32: a killed master serves again within this long
DAEMON_UP_S = 3.0  # and the daemon is still up this long after


async def wait_serving(front: int, timeout: float, d: Daemon) -> float:
    started = time.monotonic()
    while True:
        code, headers, _ = await http_get(front, timeout=1)
        if code == 200 and headers.get("x-tag") == "v1":
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"HAProxy not serving within {timeout}s\n{d.run_log()[-5000:]}")
        await asyncio.sleep(0.02)


async def test_a_master_killed_on_a_full_runtime_dir_serves_again_within_3s(make):
    front = free_port()
    with backends("b1") as started:
        b1 = started["b1"].address
        d = make(config(front, b1, "v1"), FAST_CONVERGE)
        with tmpfs(d.runtime, size="2m"):
            d.start()
            await d.wait_generation(1)
            loop = RequestLoop(front, max_requests=4000, max_seconds=40).start()
            await asyncio.sleep(0.3)
            filler = fill(d.runtime)
            try:
                master = d.remember_master()
                assert master is not None
                os.kill(master, signal.SIGKILL)
                back_s = await wait_serving(front, SERVING_AGAIN_S + 5, d)
                await d.wait_log(r"master started pid=\d+", timeout=5)
                await asyncio.sleep(DAEMON_UP_S)
                assert d.proc is not None and d.proc.poll() is None, f"the daemon exited\n{d.run_log()[-3000:]}"
                d.remember_master()
                procs = await d.show_proc()
                doc = await status(d)
                values = await metrics(d)
                await wait_converged(d, front, "v1", timeout=5)
            finally:
                filler.unlink()
            await asyncio.sleep(0.5)
            results = await loop.stop()
            d.cleanup()
    failed = loop.failures
    print(f"serving again {back_s:.2f}s after the master's kill; {len(failed)} of {len(results)} requests failed; "
          f"writes: {doc['writes']}")
    assert back_s < SERVING_AGAIN_S, back_s
    assert procs.master is not None and procs.master.pid != master
    assert doc["worker"]["pid"] == procs.current_worker.pid
    failing = {entry["file"]: entry["error"] for entry in doc["writes"]["failing"]}
    assert doc["writes"]["failures"] >= 1 and "No space left on device" in failing["server-state file"], doc["writes"]
    assert values["haproxy_supervisor_write_failures_total"] >= 1
    assert d.count("Traceback", whole=True) == 0, d.log()[-3000:]
    assert results[-1] == (200, "v1")


async def test_a_daemon_restarted_on_a_full_runtime_dir_starts_haproxy_on_the_last_good_config(make):
    """The daemon and its master both gone while the disk is full (a node's crash): the next
    daemon cannot write a config for HAProxy, so it starts the one on disk, the last good."""
    front = free_port()
    with backends("b1") as started:
        b1 = started["b1"].address
        d = make(config(front, b1, "v1"), FAST_CONVERGE)
        with tmpfs(d.runtime, size="2m"):
            d.start()
            await d.wait_generation(1)
            filler = fill(d.runtime)
            try:
                d.kill9()
                master = d.master_pid()
                assert master is not None
                os.kill(master, signal.SIGKILL)
                await asyncio.sleep(0.3)
                d.start()
                back_s = await wait_serving(front, 15, d)
                await asyncio.sleep(DAEMON_UP_S)
                assert d.proc is not None and d.proc.poll() is None, f"the daemon exited\n{d.run_log()[-3000:]}"
                d.remember_master()
                doc = await status(d)
            finally:
                filler.unlink()
            await wait_converged(d, front, "v1", timeout=8)
            d.cleanup()
    print(f"serving {back_s:.2f}s after the daemon's start; writes: {doc['writes']}")
    assert doc["haproxy"]["up"] is True, doc
    assert d.count("Traceback", whole=True) == 0, d.log()[-3000:]
