"""Slowloris on the status port with few file descriptors (issue 13, item 7).

The daemon runs with RLIMIT_NOFILE lowered to 256 (set on its PID, no shell). Hundreds of
connections send half a request and wait, and are reopened as the daemon closes them, for a
few seconds. Meanwhile a config change must still load, /healthz must still answer, HAProxy
must lose no request, and the log must stay a few lines: no traceback, no line per connection.
"""

from __future__ import annotations

import asyncio
import re
import resource
import time

import pytest

from rigs.daemon import RequestLoop
from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port

pytestmark = pytest.mark.haproxy

FD_LIMIT = 256
ATTACKERS = 1000  # more than the daemon has descriptors
ATTACK_S = 4.0
HEADER_TIMEOUT_S = 1.0


async def half_request(port: int) -> asyncio.StreamWriter | None:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
        writer.write(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        return writer
    except (OSError, TimeoutError):
        return None


async def healthz(port: int) -> int:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 3)
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 3)
        finally:
            writer.close()
    except (OSError, TimeoutError):
        return 0
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


async def test_slowloris_at_a_low_fd_limit(make):
    front, status_port = free_port(), free_port()
    with backends("b1") as started:
        b1 = started["b1"].address
        d = make(
            config(front, b1, "before"),
            {"status": {"listen": f"127.0.0.1:{status_port}", "header_timeout_s": HEADER_TIMEOUT_S}},
        )
        d.start()
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
        await d.wait_generation(1)
        requests = RequestLoop(front, max_requests=4000, max_seconds=30).start()
        attackers: list[asyncio.StreamWriter] = []
        probes: list[int] = []
        try:
            deadline = time.monotonic() + ATTACK_S
            changed = False
            while time.monotonic() < deadline:
                attackers = [w for w in attackers if not w.transport.is_closing()]
                opened = await asyncio.gather(*(half_request(status_port) for _ in range(ATTACKERS - len(attackers))))
                attackers += [w for w in opened if w is not None]
                if not changed:
                    d.write(config(front, b1, "after"))  # a change that arrives during the flood
                    changed = True
                probes.append(await healthz(status_port))
                await asyncio.sleep(0.2)
            await d.wait_generation(2)
        finally:
            for writer in attackers:
                writer.transport.abort()
            results = await requests.stop()
        assert probes and all(code == 200 for code in probes), probes
        assert results and not requests.failures, requests.failures[:5]
        assert results[-1] == (200, "after")
        log = d.run_log()
        assert "Traceback" not in log and "cannot accept connections" not in log, log[-3000:]
        # One line per condition, however many connections met it.
        for condition in ("connections open (status.max_connections)", "(status.header_timeout_s)"):
            assert d.count(re.escape(condition)) == 1, [x for x in log.splitlines() if "status:" in x]
        assert d.count("under the limit again") <= 1
        assert d.proc is not None and d.proc.poll() is None
