"""Fault: one write of a rendered config that cannot be read (issue 32). One atomic write of
non-UTF-8 bytes, or the file deleted, added 2 to `reloads.invalid`, logged "reload invalid"
twice and a spurious "changed with no event seen" (the safety net took the failed read for a
change it had missed). It is one invalid reload and one line; HAProxy serves on."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.support.faults import FAST_CONVERGE, serving, status

pytestmark = pytest.mark.haproxy

# Longer than the debounce, a retry and the safety net's look at the file together.
SETTLE_S = 4.0


def write_bytes_atomically(path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.parametrize("fault", ["non-utf8", "deleted"])
async def test_one_unreadable_write_is_one_invalid_reload_and_one_line(make, fault: str):
    async with serving(make, FAST_CONVERGE, settled_s=None) as node:
        d = node.daemon
        await asyncio.sleep(0.5)
        before = (await status(d))["reloads"]["invalid"]
        if fault == "non-utf8":
            write_bytes_atomically(d.rendered, b"global\n    # caf\xe9\n" + b"\xff\xfe" * 10)
        else:
            d.rendered.unlink()
        await d.wait_log(r"reload invalid", timeout=5)
        await asyncio.sleep(SETTLE_S)
        after = (await status(d))["reloads"]["invalid"]
        node.write("v1")  # the controller writes a good config again
        await asyncio.sleep(1.0)
    log = d.run_log()
    print(f"{fault}: reloads.invalid +{after - before}; lines: "
          f"{[line for line in log.splitlines() if 'invalid' in line or 'no event' in line]}")
    assert after - before == 1, log[-3000:]
    assert d.count(r"reload invalid") == 1, log[-3000:]
    assert d.count(r"no event seen") == 0, log[-3000:]
    assert "Traceback" not in log
    assert not node.loop.failures, node.loop.failures[:5]
    assert set(node.tags()) == {"v1"}
