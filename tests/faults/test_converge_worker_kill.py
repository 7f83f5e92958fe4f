"""Fault: kill -9 of HAProxy's current worker.

HAProxy's master exits when its current worker dies abnormally (exit-on-failure), taking every
old worker with it: requests are lost until a master runs again, so the daemon starts one at
once the first time after a healthy period, then backs off (1 s, 2 s ...) while it keeps
dying. In both cases the node is back on the rendered config within the stated time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.support.faults import metrics, serving, wait_converged

pytestmark = pytest.mark.haproxy

CONVERGE_WITHIN_S = 6.0


async def test_kill9_of_the_current_worker_restarts_haproxy_at_once_then_backs_off(make):
    async with serving(make) as node:
        d = node.daemon
        took: list[float] = []
        for kill, delay in ((1, "0s"), (2, "1s")):
            procs = await d.show_proc()
            assert procs.master is not None and procs.current_worker is not None
            d.remember_master()
            killed_at = time.monotonic()
            os.kill(procs.current_worker.pid, signal.SIGKILL)
            lines = await d.wait_log(rf"master restart in \S+ restarts={kill}")
            # The first death after a healthy run is restarted at once; the second, seconds later,
            # looks like a crash loop and waits.
            assert f"master restart in {delay} restarts={kill}" in lines[0], lines
            await wait_converged(d, node.front, "v1", timeout=CONVERGE_WITHIN_S)
            took.append(time.monotonic() - killed_at)
            new_master = (await d.show_proc()).master
            assert new_master is not None and new_master.pid != procs.master.pid
            d.remember_master()
        await asyncio.sleep(0.3)
    values = await metrics(d)
    results = node.loop.results
    print(f"back on the rendered config {took[0]:.2f}s after the 1st kill, {took[1]:.2f}s after the 2nd; "
          f"{len(node.loop.failures)} of {len(results)} requests failed")
    assert values["haproxy_supervisor_master_restarts_total"] == 2
    assert values["haproxy_supervisor_converged"] == 1
    assert results[-1] == (200, "v1")
