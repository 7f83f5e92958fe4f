"""Fault: a controller writes more often than the debounce.

With a write every 100 ms and `debounce_ms` 200, every write used to put the change off again:
nothing was applied for as long as the writes went on. A burst is now applied at the latest
`reload.max_delay_ms` after its first write, whatever the write rate; the daemon never says
converged while HAProxy serves an older config.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.faults import FAST_CONVERGE, serving, wait_converged

pytestmark = pytest.mark.haproxy

WRITE_EVERY_S = 0.1
WRITES = 60
SETTINGS = {"reload": {**FAST_CONVERGE["reload"], "debounce_ms": 200, "max_delay_ms": 1000}}
# The first write's change is applied within max_delay plus a check and a reload on a busy machine.
FIRST_APPLIED_WITHIN_S = 4.0


async def test_writes_closer_than_the_debounce_are_applied_within_the_maximum_wait(make):
    async with serving(make, SETTINGS) as node:
        d = node.daemon
        started = time.monotonic()
        first_new_at: float | None = None
        for i in range(WRITES):
            node.write(f"w{i}")
            await asyncio.sleep(WRITE_EVERY_S)
            if first_new_at is None and any(tag.startswith("w") for tag in node.tags()):
                first_new_at = time.monotonic() - started
        storm_s = time.monotonic() - started
        took = await wait_converged(d, node.front, f"w{WRITES - 1}", timeout=10)
        await asyncio.sleep(1.5)  # the honesty samples once the file is settled
    tags = node.tags()
    during = {t for t in tags if t.startswith("w")}
    print(f"storm {storm_s:.1f}s; first new tag served after {first_new_at}s; {len(during)} tags served; "
          f"converged {took:.2f}s after the last write; {node.honesty.samples} honesty samples")
    assert first_new_at is not None and first_new_at < FIRST_APPLIED_WITHIN_S, (
        f"no write applied while the storm went on ({storm_s:.1f}s)\n{d.run_log()}"
    )
    assert d.count(r"reload ok") >= 3, "a reload about every max_delay_ms while the writes go on"
    assert not node.loop.failures, node.loop.failures[:5]
    assert d.count("Traceback") == 0
