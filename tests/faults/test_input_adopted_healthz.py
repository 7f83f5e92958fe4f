"""Fault: after a daemon restart that adopts a running master, /healthz said 503 ("HAProxy
master is not running") while HAProxy served, until the daemon had asked the master for a
ready worker (up to 0.9 s in issue 32; as long as a crowded master CLI leaves that question
unanswered). /healthz is 200 from the moment the adopted master is known to run (found by the
socket it holds); /readyz waits for the worker, as before."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from tests.support.faults import crowd, get, serving, wait_converged

pytestmark = pytest.mark.haproxy

# Adoption waits this long for a ready worker; the crowd is lifted well before.
SETTINGS = {"reload": {"timeout_s": 10, "retry_max_s": 1, "converge_grace_s": 1}}
CROWD = 64
CROWDED_S = 2.0


async def probe(d, path: str) -> int:
    try:
        code, _ = await get(d, path)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return 0
    return code


async def test_healthz_is_200_while_an_adopted_master_is_asked_for_its_worker(make):
    async with serving(make, SETTINGS, settled_s=None) as node:
        d = node.daemon
        d.signal(signal.SIGQUIT)
        assert await d.wait_exit() == 3
        held = crowd(d, CROWD)
        try:
            d.start()
            await d.wait_log(r"haproxy-supervisor starting", timeout=15)
            started = time.monotonic()
            samples: list[tuple[int, int]] = []
            while time.monotonic() - started < CROWDED_S:
                samples.append(tuple(await asyncio.gather(probe(d, "/healthz"), probe(d, "/readyz"))))
                await asyncio.sleep(0.05)
            adopted_meanwhile = d.count(r"master adopted") > 0
        finally:
            for sock in held:
                sock.close()
        await d.wait_log(r"master adopted", timeout=10)
        await wait_converged(d, node.front, "v1", timeout=10)
        after = await asyncio.gather(probe(d, "/healthz"), probe(d, "/readyz"))
    print(f"while the master CLI was crowded ({len(samples)} samples, adopted meanwhile: {adopted_meanwhile}): "
          f"/healthz {sorted(set(h for h, _ in samples))}, /readyz {sorted(set(r for _, r in samples))}")
    assert not adopted_meanwhile, "the crowd held the adoption up, or the test shows nothing"
    assert samples and all(h == 200 for h, _ in samples), samples
    assert all(r == 503 for _, r in samples), "not ready before its worker is known"
    assert after == [200, 200]
    assert not node.loop.failures, node.loop.failures[:5]
