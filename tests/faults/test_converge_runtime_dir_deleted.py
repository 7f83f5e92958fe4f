"""Fault: runtime_dir deleted while HAProxy runs (an overeager cleanup, a tmpfiles rule).

The master keeps running and its worker keeps serving (no request may be lost), but its socket
file is gone, so nobody can reach it. The daemon notices, recreates what it owns, and makes
the master bind its socket again (it re-executes on SIGUSR2); /healthz says 503 until it has.
Changes then go through again. And a daemon started while the socket file is gone must find
the master by process facts and take it back, never start a second HAProxy beside it.
"""

from __future__ import annotations

import asyncio
import shutil
import signal

import pytest

from rigs.daemon import RequestLoop
from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port
from supervisor.master.processes import find_masters
from supervisor.settings import load_settings
from tests.support.faults import FAST_CONVERGE, fill, get, serving, status, tmpfs, wait_converged

pytestmark = pytest.mark.haproxy

CONVERGE_WITHIN_S = 10.0


async def test_runtime_dir_deleted_under_a_running_daemon_is_recreated_and_haproxy_reached_again(make):
    async with serving(make) as node:
        d = node.daemon
        master = d.remember_master()  # stopped by the test's cleanup whatever happens: the pid file goes too
        shutil.rmtree(d.runtime)
        await d.wait_log(r"master\.sock is missing")
        await d.wait_log(r"runtime_dir recreated")
        for name in ("master.sock", "haproxy.cfg", "steer.map", "generations.json"):
            assert (d.runtime / name).exists(), name
        procs = await d.show_proc()
        assert procs.master is not None and procs.master.pid == master, "the same master, reached again"
        node.write("v2")
        took = await wait_converged(d, node.front, "v2", timeout=CONVERGE_WITHIN_S)
        await asyncio.sleep(0.3)
    print(f"recreated, then converged on a change in {took:.2f}s; {len(node.loop.results)} requests")
    assert d.count("Traceback") == 0
    assert len(node.loop.results) > 50
    assert not node.loop.failures, node.loop.failures[:5]
    tags = node.tags()
    assert tags[0] == "v1" and tags[-1] == "v2" and set(tags) == {"v1", "v2"}


async def test_a_daemon_started_after_runtime_dir_was_deleted_takes_the_running_master_back(make):
    async with serving(make) as node:
        d = node.daemon
        master = d.remember_master()
        # The daemon is stopped before it can notice, and killed: nothing recreates runtime_dir.
        d.signal(signal.SIGSTOP)
        shutil.rmtree(d.runtime)
        d.kill9()
        node.write("v2")
        d.start()
        took = await wait_converged(d, node.front, "v2", timeout=CONVERGE_WITHIN_S)
        await asyncio.sleep(0.3)
        masters = find_masters(load_settings(d.settings_path))
        doc = await status(d)
    print(f"taken back and converged in {took:.2f}s; {len(node.loop.results)} requests")
    assert masters == [master], f"one HAProxy master for this runtime_dir, the one that ran: {masters}"
    assert doc["haproxy"]["master_pid"] == master
    assert d.count(r"starting haproxy master") == 0, d.run_log()
    assert d.count("Traceback") == 0
    assert not node.loop.failures, node.loop.failures[:5]
    tags = node.tags()
    assert tags[0] == "v1" and tags[-1] == "v2" and set(tags) == {"v1", "v2"}


async def test_health_says_so_while_the_master_socket_cannot_be_brought_back(make):
    """The socket file is removed and runtime_dir cannot be written (full): the daemon
    cannot reach HAProxy until it can write again, and /healthz and /readyz say so meanwhile;
    HAProxy's worker keeps serving."""
    front = free_port()
    with backends("b1") as started:
        d = make(config(front, started["b1"].address, "v1"), FAST_CONVERGE)
        with tmpfs(d.runtime, size="2m"):
            d.start()
            await d.wait_generation(1)
            master = d.remember_master()
            loop = RequestLoop(front, max_requests=4000, max_seconds=40).start()
            (d.runtime / "master.sock").unlink()
            filler = fill(d.runtime)
            try:
                await d.wait_log(r"master\.sock is missing")
                lines = await d.wait_log(r"cannot write back the running config")
                assert "No space left on device" in lines[0]
                for endpoint in ("/healthz", "/readyz"):
                    code, text = await get(d, endpoint)
                    assert code == 503 and "socket is missing" in text, (endpoint, code, text)
                await asyncio.sleep(1.5)  # more rounds, no more lines
            finally:
                filler.unlink()
            await d.wait_log(r"runtime_dir recreated")
            assert (await get(d, "/healthz"))[0] == 200
            await wait_converged(d, front, "v1", timeout=CONVERGE_WITHIN_S)
            assert (await d.show_proc()).master.pid == master
            results = await loop.stop()
            d.cleanup()
    assert d.count(r"cannot write back the running config", whole=True) == 1, "one line per condition"
    assert d.count("Traceback", whole=True) == 0
    assert len(results) > 50 and not loop.failures, loop.failures[:5]
