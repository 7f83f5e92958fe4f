"""Fault: HAProxy itself refuses a config that passed `haproxy -c` (a port held by another
process).

The config is the problem, not something passing around it, and each attempt costs traffic:
while HAProxy 2.6 tries a config, the serving worker pauses its listeners ("Paused frontend")
and refuses new connections until the attempt has failed. So the daemon does not retry by
itself, and /readyz stays 200 (HAProxy serves the last good config; a config rendered for every
node would otherwise empty the fleet); the node shows as not converged, with HAProxy's reason.
Once the port is free, a forced reload (SIGHUP) loads it.
"""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from rigs.harness import free_port
from tests.support.faults import FAST_CONVERGE, readyz, serving, status, wait_converged

pytestmark = pytest.mark.haproxy

CONVERGE_WITHIN_S = 8.0
# A refused reload takes 2.6 about a second to report (the master re-executes, fails to bind,
# falls back): a timeout that lets it say so.
SETTINGS = {**FAST_CONVERGE, "reload": {**FAST_CONVERGE["reload"], "timeout_s": 5}}


async def test_a_config_haproxy_refuses_is_not_retried_by_itself_and_loads_once_asked_again(make):
    holder = socket.socket()
    holder.bind(("127.0.0.1", free_port()))
    holder.listen(1)
    busy_frontend = f"\nfrontend busy\n    bind 127.0.0.1:{holder.getsockname()[1]}\n    default_backend app\n"
    try:
        async with serving(make, SETTINGS) as node:
            d = node.daemon
            node.write("v2", lambda text: text + busy_frontend)
            await d.wait_log(r"reload (settled )?failed")
            await asyncio.sleep(0.5)  # the worker resumes its listeners
            refused_at = len(node.loop.results)
            await asyncio.sleep(2.5)  # longer than retry_max_s and converge_grace_s
            doc = await status(d)
            assert doc["convergence"]["converged"] is False and doc["convergence"]["transient"] is False
            assert "HAProxy refused the new config" in doc["convergence"]["reason"], doc["convergence"]
            assert doc["convergence"]["next_attempt_at"] is None
            assert (await readyz(d))[0] == 200, "HAProxy serves the last good config: the node stays in"
            assert d.count(r"converge: attempt") == 0, "no attempt by itself"
            quiet = node.loop.results[refused_at:]
            holder.close()
            d.signal(signal.SIGHUP)
            took = await wait_converged(d, node.front, "v2", timeout=CONVERGE_WITHIN_S)
            await asyncio.sleep(0.3)
    finally:
        holder.close()
    print(f"converged {took:.2f}s after SIGHUP; {len(node.loop.failures)} of {len(node.loop.results)} requests "
          "failed (HAProxy's pause while it tried the refused config)")
    assert len(quiet) > 50 and all(code == 200 for code, _ in quiet), "no pause while the daemon waits"
    assert node.tags()[-1] == "v2"
