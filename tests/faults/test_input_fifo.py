"""A FIFO as the rendered config (issue 13, item 5): refused in one line, while HAProxy keeps
serving the last good config with no request lost and /healthz keeps answering at once;
a good config written afterwards is loaded."""

from __future__ import annotations

import asyncio
import os

import pytest

from rigs.daemon import one_backend
from rigs.daemon import tagged_config as config

pytestmark = pytest.mark.haproxy

# Nobody writes into the FIFO: a daemon that opens it for reading waits forever. A /healthz
# that has not answered after this long is stuck behind it.
HEALTHZ_STUCK_S = 3.0


async def test_a_fifo_as_the_rendered_config_blocks_nothing(make):
    async with one_backend(make, tag="good") as node:
        d, front, b1 = node.daemon, node.front, node.backend
        requests = node.requests(max_requests=4000, max_seconds=30)
        try:
            # Renamed into place, the way a controller writes its files.
            fifo = d.rendered.with_name(".rendered.fifo")
            os.mkfifo(fifo)
            os.replace(fifo, d.rendered)
            refusals = await d.wait_log(r"reload invalid: .*haproxy\.cfg: cannot read rendered config: a FIFO")
            assert len(refusals) == 1 and "Traceback" not in d.run_log()
            for _ in range(5):
                await d.healthz_seconds(HEALTHZ_STUCK_S)
                await asyncio.sleep(0.05)
            served = len(requests.results)
            await asyncio.sleep(0.3)
            assert len(requests.results) > served, "HAProxy stopped serving"

            d.write(config(front, b1, "back"))
            await d.wait_generation(2)
        finally:
            results = await requests.stop()
        assert results and not requests.failures, requests.failures[:5]
        assert results[-1] == (200, "back")
        assert d.count("Traceback") == 0


async def test_a_fifo_among_the_watched_files_blocks_nothing(make, tmp_path):
    maps = tmp_path / "maps"
    maps.mkdir()
    (maps / "hosts.map").write_text("a b\n")
    async with one_backend(make, {"haproxy": {"watch": [str(maps)]}}, tag="good") as node:
        d = node.daemon
        os.mkfifo(maps / "dropped.fifo")
        (maps / "hosts.map").write_text("a c\n")  # a watched change: a reload, which digests the directory
        await d.wait_generation(2)
        await d.healthz_seconds(HEALTHZ_STUCK_S)
        assert d.count("Traceback") == 0
