"""A steered old worker's connect retries meeting black-holed servers the daemon knows dead, in a
network namespace (rigs/netns.py): three servers under the daemon, held keep-alive
connections in an old worker, r1 and r2 black-holed by nftables while requests on those
connections are connecting, then marked dead by the operator. The old worker is steered off
them, and HAProxy retries the connects it already began (`option redispatch 1`, the guard's):
a retry can meet the other dead server. The detector's stall threshold is set far above the
run, so no server becomes suspect: only the known-dead rule can abort those connects. With
`observe`, the servers have checks and the daemon's observe gate is on, as under Ray: the guard
adds `observe layer4 ... on-error mark-down`, which an old worker obeys, its aborted connects
counted."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import aiohttp

from rigs.daemon import Daemon
from rigs.harness import KeepAliveClient, backends, free_port
from rigs.netns import drop_port

CONNECT_TIMEOUT_S = 2.0
RETRIES = 3
# No `option redispatch`: the guard adds `option redispatch 1`. `http-server-close`: every request
# connects anew (a pooled connection would be another case, the detector's suspects).
CONFIG = """\
global
    hard-stop-after 60s

defaults
    mode http
    timeout connect {connect_ms}ms
    timeout client 30s
    timeout server 10s
    retries {retries}
    retry-on conn-failure
    option http-server-close
    option idle-close-on-response

frontend fe
    bind 127.0.0.1:{front}
    http-response set-header x-tag {tag}
    default_backend app

backend app
    balance roundrobin
    server r1 127.0.0.1:{r1}{check}
    server r2 127.0.0.1:{r2}{check}
    server r3 127.0.0.1:{r3}{check}
"""


async def _post(daemon: Daemon, path: str) -> int:
    connector = aiohttp.UnixConnector(path=str(daemon.directory / "status.sock"))
    async with aiohttp.ClientSession(connector=connector) as session, session.post(f"http://daemon{path}") as r:
        return r.status


async def staged(*, abort: bool, observe: bool = False, requests: int = 9) -> dict[str, object]:
    """(status, server, seconds) of each request on a held connection after the vanish, the
    daemon's log lines of what it destroyed, and whether the effective config redispatches."""
    with tempfile.TemporaryDirectory(prefix="hs-rabort-") as tmp, backends("r1", "r2", "r3") as servers:
        front = free_port()
        ports = {name: s.port for name, s in servers.items()}

        def config(tag: str) -> str:
            return CONFIG.format(front=front, tag=tag, connect_ms=int(CONNECT_TIMEOUT_S * 1000), retries=RETRIES,
                                 check=" check inter 60s" if observe else "", **ports)

        daemon = Daemon(Path(tmp), config("one"), {
            "old_workers": {"guard": True},
            "detector": {"enabled": True, "abort": abort, "threshold_floor_ms": 60_000},
            "observe": {"enabled": observe},
        })
        try:
            daemon.start()
            await daemon.wait_generation(1, timeout=60)
            held = [await KeepAliveClient(front).connect() for _ in range(requests)]
            for client in held:
                assert (await client.get())[0] == 200
            daemon.write(config("two"))
            await daemon.wait_generation(2, timeout=60)
            effective = (daemon.runtime / "haproxy.cfg").read_text()
            drop_port(ports["r1"])
            drop_port(ports["r2"])

            jobs = [asyncio.create_task(c.get(timeout=5 * CONNECT_TIMEOUT_S)) for c in held]
            await asyncio.sleep(0.1)  # their connects are under way, two in three to r1 or r2
            for name in ("r1", "r2"):
                assert await _post(daemon, f"/servers/app/{name}/dead") == 200
            answers = [await job for job in jobs]
            for client in held:
                await client.close()
            log = daemon.log()
            return {
                "answers": answers,
                "destroyed": [line for line in log.splitlines() if "destroyed" in line],
                "effective_redispatch": [line.strip() for line in effective.splitlines() if "redispatch" in line],
                "observed": sum("on-error mark-down" in line for line in effective.splitlines()),
            }
        finally:
            daemon.cleanup()


def run_staged(**kwargs: object) -> dict[str, object]:
    return asyncio.run(staged(**kwargs))  # type: ignore[arg-type]
