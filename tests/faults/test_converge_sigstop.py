"""Fault: HAProxy's master is stopped (SIGSTOP) across a write of the rendered config.

The worker is untouched, so no request may be lost. While the master cannot answer, the
reload cannot be confirmed; the change must not be lost: once the master runs again the
node converges to the rendered config (within the stated time), and while it has not,
/readyz, /status and the metrics say so.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.support.faults import metrics, serving, status, wait_converged, wait_unready

pytestmark = pytest.mark.haproxy

STOPPED_S = 3.0
# After SIGCONT: the next attempt is at most reload.retry_max_s (1 s) away, plus a reload.
CONVERGE_WITHIN_S = 8.0


async def test_a_change_written_while_the_master_is_stopped_is_loaded_once_it_runs_again(make):
    async with serving(make) as node:
        d = node.daemon
        master = d.master_pid()
        assert master is not None
        os.kill(master, signal.SIGSTOP)
        try:
            node.write("v2")
            await d.wait_log(r"reload (failed|unknown)", timeout=10)
            reason = await wait_unready(d, timeout=10)
            assert "not converged" in reason, reason
            values = await metrics(d)
            assert values["haproxy_supervisor_converged"] == 0
            assert values["haproxy_supervisor_unconverged_seconds"] > 1
            doc = await status(d)
            assert doc["convergence"]["converged"] is False and doc["convergence"]["transient"] is True
            await asyncio.sleep(max(0.0, STOPPED_S - 2))
        finally:
            os.kill(master, signal.SIGCONT)
        took = await wait_converged(d, node.front, "v2", timeout=CONVERGE_WITHIN_S)
        await asyncio.sleep(0.3)
    values = await metrics(d)
    results = node.loop.results
    print(f"converged {took:.2f}s after SIGCONT; {len(results)} requests")
    assert values["haproxy_supervisor_converged"] == 1 and values["haproxy_supervisor_unconverged_seconds"] == 0
    assert (await d.show_proc()).master.pid == master, "the same master: nothing was restarted"
    assert d.count(r"converge: attempt \d+") >= 1, "each attempt is logged"
    assert d.count("Traceback") == 0
    assert len(results) > 50, len(results)
    assert not node.loop.failures, node.loop.failures[:5]
    tags = node.tags()
    assert tags[0] == "v1" and tags[-1] == "v2" and set(tags) == {"v1", "v2"}
