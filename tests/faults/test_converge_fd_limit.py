"""Fault: the daemon runs out of file descriptors across a write (its RLIMIT_NOFILE lowered,
from outside, to what it holds already).

It cannot open the rendered config, start `haproxy -c` nor reach the master: each attempt
fails with one log line, and is tried again. HAProxy's worker is untouched: no request is
lost. Once descriptors can be had again, the node converges within the stated time.
"""

from __future__ import annotations

import asyncio

import psutil
import pytest

from tests.support.faults import serving, wait_converged

pytestmark = pytest.mark.haproxy

CONVERGE_WITHIN_S = 8.0


async def test_a_change_written_while_the_daemon_has_no_descriptor_left_is_loaded_once_it_has(make):
    async with serving(make) as node:
        d = node.daemon
        daemon = psutil.Process(d.pid)
        limits = daemon.rlimit(psutil.RLIMIT_NOFILE)
        daemon.rlimit(psutil.RLIMIT_NOFILE, (daemon.num_fds(), limits[1]))
        try:
            node.write("v2")
            lines = await d.wait_log(r"reload failed", timeout=10)
            assert "Too many open files" in lines[0], lines
            await d.wait_log(r"converge: attempt 2", timeout=10)
        finally:
            daemon.rlimit(psutil.RLIMIT_NOFILE, limits)
        took = await wait_converged(d, node.front, "v2", timeout=CONVERGE_WITHIN_S)
        await asyncio.sleep(0.3)
    print(f"converged {took:.2f}s after descriptors were available again; {len(node.loop.results)} requests")
    assert d.count(r"reload invalid") == 0, "a shortage of the daemon is not a bad config"
    assert d.count(r"reload failed: .*Too many open files") >= 2
    assert d.count("Traceback") == 0, d.run_log()
    assert len(node.loop.results) > 50
    assert not node.loop.failures, node.loop.failures[:5]
    tags = node.tags()
    assert tags[0] == "v1" and tags[-1] == "v2" and set(tags) == {"v1", "v2"}
