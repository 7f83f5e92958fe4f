"""Fault: runtime_dir deleted while HAProxy runs (an overeager cleanup, a tmpfiles rule).

The master keeps running and its worker keeps serving (no request may be lost), but its socket
file is gone, so nobody can reach it. The daemon notices, recreates what it owns, and makes
the master bind its socket again (it re-executes on SIGUSR2); /healthz says 503 until it has.
Changes then go through again.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tests.support.daemon import RequestLoop
from tests.support.daemon import tagged_config as config
from tests.support.faults import FAST_CONVERGE, wait_converged
from tests.support.harness import backends, free_port

pytestmark = pytest.mark.haproxy

CONVERGE_WITHIN_S = 10.0


async def test_runtime_dir_deleted_under_a_running_daemon_is_recreated_and_haproxy_reached_again(make):
    front = free_port()
    with backends("b1") as started:
        b1 = started["b1"].address
        d = make(config(front, b1, "v1"), FAST_CONVERGE)
        d.start()
        await d.wait_generation(1)
        master = d.master_pid()
        loop = RequestLoop(front, max_requests=4000, max_seconds=40).start()
        await asyncio.sleep(0.3)
        shutil.rmtree(d.runtime)
        await d.wait_log(r"master\.sock is missing")
        await d.wait_log(r"runtime_dir recreated")
        for name in ("master.sock", "haproxy.cfg", "steer.map", "generations.json"):
            assert (d.runtime / name).exists(), name
        procs = await d.show_proc()
        assert procs.master is not None and procs.master.pid == master, "the same master, reached again"
        d.write(config(front, b1, "v2"))
        took = await wait_converged(d, front, "v2", timeout=CONVERGE_WITHIN_S)
        await asyncio.sleep(0.3)
        results = await loop.stop()
    print(f"recreated, then converged on a change in {took:.2f}s; {len(results)} requests")
    assert d.count("Traceback") == 0
    assert len(results) > 50
    assert not loop.failures, loop.failures[:5]
    tags = [t for _, t in results]
    assert tags[0] == "v1" and tags[-1] == "v2" and set(tags) == {"v1", "v2"}

