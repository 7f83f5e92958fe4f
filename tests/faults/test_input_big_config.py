"""A big rendered config is read and parsed off the event loop (issue 13, item 5): while the
daemon takes it in, /healthz keeps answering in a small fraction of the parse's time."""

from __future__ import annotations

import asyncio
import time

import pytest

from rigs.daemon import one_backend
from rigs.daemon import tagged_config as config
from supervisor.effective import build_effective
from supervisor.settings import load_settings

pytestmark = pytest.mark.haproxy

LINES = 600_000


def big_config(front: int, server: str, tag: str) -> str:
    """Big where only our parser pays: comment lines cost HAProxy next to nothing, and the
    displaced-worker component (which also works on the loop per backend and server) no more
    than for the small config; the time between the write and the reload is the read and parse."""
    return config(front, server, tag) + "".join(f"    # line {i} of a long comment\n" for i in range(LINES))


async def test_healthz_answers_while_a_big_config_is_parsed(make):
    async with one_backend(make, tag="small") as node:
        d, front, b1 = node.daemon, node.front, node.backend
        text = big_config(front, b1, "big")
        # The parse on this machine, now: what /healthz would wait for if it ran on the loop.
        settings = load_settings(d.settings_path, environ={})
        began = time.monotonic()
        build_effective(settings, text)
        parse_s = time.monotonic() - began

        d.write(text)
        latencies: list[float] = []
        deadline = time.monotonic() + 60
        while not d.count(r"reload (ok|invalid|failed)") and time.monotonic() < deadline:
            latencies.append(await d.healthz_seconds(30))
            await asyncio.sleep(0.02)
        await d.wait_generation(2, timeout=60)
        worst = max(latencies)
        assert len(latencies) > 5
        assert worst < parse_s / 2, f"/healthz waited {worst:.2f}s; the parse takes {parse_s:.2f}s"
