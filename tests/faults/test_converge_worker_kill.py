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

from tests.support.daemon import RequestLoop
from tests.support.daemon import tagged_config as config
from tests.support.faults import FAST_CONVERGE, metrics, wait_converged
from tests.support.harness import backends, free_port

pytestmark = pytest.mark.haproxy

CONVERGE_WITHIN_S = 6.0


async def test_kill9_of_the_current_worker_restarts_haproxy_at_once_then_backs_off(make):
    front = free_port()
    with backends("b1") as started:
        d = make(config(front, started["b1"].address, "v1"), FAST_CONVERGE)
        d.start()
        await d.wait_generation(1)
        loop = RequestLoop(front, max_requests=4000, max_seconds=40).start()
        await asyncio.sleep(0.3)
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
            await wait_converged(d, front, "v1", timeout=CONVERGE_WITHIN_S)
            took.append(time.monotonic() - killed_at)
            new_master = (await d.show_proc()).master
            assert new_master is not None and new_master.pid != procs.master.pid
            d.remember_master()
        await asyncio.sleep(0.3)
        results = await loop.stop()
        values = await metrics(d)
    lost = len(loop.failures)
    print(f"back on the rendered config {took[0]:.2f}s after the 1st kill, {took[1]:.2f}s after the 2nd; "
          f"{lost} of {len(results)} requests failed")
    assert values["haproxy_supervisor_master_restarts_total"] == 2
    assert values["haproxy_supervisor_converged"] == 1
    assert results[-1] == (200, "v1")
