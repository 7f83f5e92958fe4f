"""End to end: forced reloads (POST /reload, SIGHUP) honour reload.min_interval_ms and coalesce.

Requests made before a forced reload starts join it; one made while it runs gets the next
one, at least min_interval_ms later. HAProxy's own reload counter (`show proc`) is the judge.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port

pytestmark = pytest.mark.haproxy

MIN_INTERVAL_S = 1.0


async def master_reloads(d) -> int:
    procs = await d.show_proc()
    assert procs.master is not None
    return procs.master.reloads


async def wait_quiet(d, reloads: int, settle_s: float = MIN_INTERVAL_S + 1.0) -> int:
    """Wait until HAProxy's reload counter has not moved for `settle_s`; returns it."""
    while True:
        await asyncio.sleep(settle_s)
        now = await master_reloads(d)
        if now == reloads:
            return now
        reloads = now


async def test_concurrent_post_reload_and_a_burst_of_sighup_coalesce(make):
    front = free_port()
    with backends("b1") as started:
        d = make(
            config(front, started["b1"].address, "v1"),
            {"reload": {"min_interval_ms": int(MIN_INTERVAL_S * 1000)}},
        )
        d.start()
        await d.wait_generation(1)
        before = await master_reloads(d)

        connector = aiohttp.UnixConnector(path=str(d.directory / "status.sock"), limit=20)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def post() -> tuple[int, dict]:
                async with session.post("http://daemon/reload") as r:
                    return r.status, json.loads(await r.text())

            answers = await asyncio.gather(*(post() for _ in range(10)))
        assert all(code == 200 for code, _ in answers), answers
        assert all(body["reload"]["result"] == "ok" for _, body in answers), answers
        after_posts = await wait_quiet(d, await master_reloads(d))
        posts_reloads = after_posts - before
        # One reload for all of them, or two if some arrived once the first had started.
        assert 1 <= posts_reloads <= 2, f"10 concurrent POST /reload gave {posts_reloads} reloads"
        assert len({body["reload"]["at"] for _, body in answers}) == posts_reloads

        sent_at = time.monotonic()
        for _ in range(20):
            d.signal(signal.SIGHUP)
            await asyncio.sleep(0.05)
        burst_s = time.monotonic() - sent_at
        after_hups = await wait_quiet(d, await master_reloads(d))
        hup_reloads = after_hups - after_posts
        # A burst of ~1 s with reloads at least 1 s apart: two or three, never twenty.
        assert 1 <= hup_reloads <= int(burst_s / MIN_INTERVAL_S) + 2, (
            f"20 SIGHUPs over {burst_s:.1f}s gave {hup_reloads} reloads"
        )
        print(f"10 concurrent POST /reload: {posts_reloads} reloads; 20 SIGHUPs over {burst_s:.2f}s: "
              f"{hup_reloads} reloads")
        assert d.count(r"joins the reload already due") >= 9 + 20 - hup_reloads - posts_reloads
