"""A staged vanished server, in a network namespace (rigs/netns.py): HAProxy in front
of two servers under the daemon, one of them black-holed (or partitioned) by nftables, and
requests on new connections (the current worker) and on held ones (an old worker).
Shared by tests/test_detector_e2e.py and bench/drain.py's vanished variants."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rigs.daemon import Daemon
from rigs.harness import KeepAliveClient, backends, free_port
from rigs.http_requests import http_get
from rigs.netns import drop_port, lift_drop

# Ray Serve's shape: pooled server connections, no `timeout server`, Ray's check timings.
CONFIG = """\
global
    hard-stop-after 60s

defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout http-keep-alive 60s
    retries 3
    option redispatch 1
    retry-on {retry_on}
    http-reuse {reuse}
    option idle-close-on-response

frontend fe
    bind 127.0.0.1:{front}
    http-response set-header x-tag {tag}
    default_backend app

backend app
    balance {balance}
    server r1 127.0.0.1:{r1} check inter {inter} fastinter 250ms fall 2 rise 2
    server r2 127.0.0.1:{r2} check inter {inter} fastinter 250ms fall 2 rise 2
"""


@dataclass
class Outcome:
    """Requests after the vanish: (status, server, seconds), per mode."""

    held: list[tuple[int, str, float]] = field(default_factory=list)  # on an old worker's connections
    held_after_lift: list[tuple[int, str, float]] = field(default_factory=list)  # the old worker's, once r2 is back
    new: list[tuple[int, str, float]] = field(default_factory=list)  # new connections, the current worker
    suspects: list[str] = field(default_factory=list)
    back_after_s: float | None = None  # after the drop was lifted, until r2 answered again
    vanished_at: float = 0.0  # time.time() of the drop
    daemon_log: str = ""

    def figures(self, mode: str) -> tuple[int, int, float]:
        rows = self.held if mode == "held" else self.new
        failed = sum(1 for status, _, _ in rows if status != 200)
        slow = sum(1 for _, _, s in rows if s > 0.5)
        return failed, slow, max((s for _, _, s in rows), default=0.0)


async def _status_suspects(daemon: Daemon) -> list[str]:
    reader, writer = await asyncio.open_unix_connection(str(daemon.directory / "status.sock"))
    writer.write(b"GET /status HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    import json

    body = json.loads(raw.partition(b"\r\n\r\n")[2])
    return sorted(s["server"] for s in body.get("suspect_servers", []))


async def staged(
    *, detector: bool, partition: bool = False, requests: int = 10, spacing_s: float = 0.2, balance: str = "roundrobin",
    inter: str = "5s", lift: bool = False, reuse_before: bool = True, settings: dict | None = None,
    fresh_requests: bool = True, retry_on: str = "conn-failure empty-response response-timeout", reuse: str = "always",
    held_after_lift: int = 0,
) -> Outcome:
    """One staged vanish of r2. `partition`: r2's port dropped both ways while r2 lives, after a
    request left a pooled connection to it; else only new packets to it are dropped.
    `fresh_requests`: also requests on new connections (the current worker's own).
    `held_after_lift`: held connections kept for requests once r2 answers the current worker
    again and the detector's `hold_s` has passed."""
    outcome = Outcome()
    with tempfile.TemporaryDirectory(prefix="hs-vanish-") as tmp, backends("r1", "r2") as servers:
        front = free_port()
        r1, r2 = servers["r1"].port, servers["r2"].port

        def config(tag: str) -> str:
            return CONFIG.format(
                front=front, tag=tag, r1=r1, r2=r2, balance=balance, inter=inter, retry_on=retry_on, reuse=reuse
            )

        daemon = Daemon(Path(tmp), config("one"), {
            "old_workers": {"guard": True}, "detector": {"enabled": detector}, **(settings or {}),
        })
        try:
            daemon.start()
            await daemon.wait_generation(1, timeout=60)
            # At soft-stop an old worker answers one more request on each idle client connection
            # (`option idle-close-on-response`): one held connection per request after the vanish.
            held = [await KeepAliveClient(front).connect() for _ in range(requests + held_after_lift)]
            if reuse_before:  # both servers get a pooled connection in the worker that becomes old
                for client in held:
                    await client.get()
            daemon.write(config("two"))
            await daemon.wait_generation(2, timeout=60)
            for _ in range(4):  # and in the current worker
                await http_get(front)
            await asyncio.sleep(0.3)
            drop_port(r2, both_ways=partition)
            outcome.vanished_at = time.time()
            async def fresh() -> tuple[int, str, float]:
                started = time.monotonic()
                status, _, body = await http_get(front, timeout=30)
                return status, body, time.monotonic() - started

            # One request every `spacing_s` in each mode, answers awaited together: a hang
            # costs the run 30 s once, not once per request.
            jobs = []
            for i in range(requests):
                jobs.append((asyncio.create_task(held[i].get(timeout=30)),
                             asyncio.create_task(fresh()) if fresh_requests else None))
                await asyncio.sleep(spacing_s)
            for on_held, on_new in jobs:
                outcome.held.append(await on_held)
                if on_new is not None:
                    outcome.new.append(await on_new)
            outcome.suspects = await _status_suspects(daemon)
            if lift:
                lift_drop(r2)
                lifted = time.monotonic()
                while time.monotonic() - lifted < 20:
                    _, _, body = await http_get(front, timeout=5)
                    if body == "r2":
                        outcome.back_after_s = time.monotonic() - lifted
                        break
                    await asyncio.sleep(0.1)
                if held_after_lift:
                    hold_s = float((settings or {}).get("detector", {}).get("hold_s", 5))
                    await asyncio.sleep(hold_s + 1.0)  # the suspect let go, and the push after it
                    for client in held[requests:]:
                        outcome.held_after_lift.append(await client.get(timeout=10))
            for client in held:
                await client.close()
        finally:
            daemon.cleanup()
            outcome.daemon_log = daemon.log_path.read_text(errors="replace")
            keep = os.environ.get("HS_VANISH_KEEP_LOG")
            if keep:
                shutil.copy(daemon.log_path, keep)
    return outcome


def run_staged(**kwargs: object) -> Outcome:
    return asyncio.run(staged(**kwargs))  # type: ignore[arg-type]


SLOW_CONFIG = """\
global
    hard-stop-after 30s

defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
    http-reuse always

frontend fe
    bind 127.0.0.1:{front}
    default_backend app

backend app
    server slow 127.0.0.1:{port}
"""


async def staged_status(port: int, *, requests: int, wait_s: float) -> dict[str, object]:
    """Requests to the one server at `port` at once; the daemon's suspects `wait_s` later, while
    they wait, and the statuses they end with."""
    with tempfile.TemporaryDirectory(prefix="hs-slow-") as tmp:
        front = free_port()
        daemon = Daemon(Path(tmp), SLOW_CONFIG.format(front=front, port=port))
        try:
            daemon.start()
            await daemon.wait_generation(1, timeout=60)
            pending = [asyncio.create_task(http_get(front, timeout=20)) for _ in range(requests)]
            await asyncio.sleep(wait_s)
            suspects = await _status_suspects(daemon)
            answers = await asyncio.gather(*pending)
            return {"suspects_while_waiting": suspects, "statuses": [a[0] for a in answers]}
        finally:
            daemon.cleanup()
