"""The pooled-connection hang of issue 31, with HAProxy alone, inside namespaces of its own:
`http-reuse always` and no `timeout server` (Ray Serve's template), an idle pooled connection
to a server that then vanishes (nftables drops its port both ways, its process alive), and the
next request balanced to it goes out on that connection and gets no answer.

    python -m tests.support.pooled_hang --out FILE --dir DIR   (run through in_namespace)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._ray_evidence import peer_port, short_ss
from bench._vanish import drop_ports
from rigs.harness import Backend, HAProxyMaster, KeepAliveClient, free_port

CLIENT_TIMEOUT_S = 6.0


def config(port: int, servers: dict[str, int]) -> str:
    return "\n".join([
        "defaults", "    mode http", "    timeout connect 1s", "    timeout client 30s",
        "    retries 3", "    option redispatch 1", "    retry-on conn-failure", "    http-reuse always",
        "    balance roundrobin",
        "frontend fe", f"    bind 127.0.0.1:{port}", "    default_backend be",
        "backend be", *(f"    server {name} 127.0.0.1:{p}" for name, p in servers.items()), "",
    ])


def haproxy_sockets_to(port: int) -> list[str]:
    found = subprocess.run(["ss", "-tnpioO"], capture_output=True, text=True, check=False).stdout
    return [short_ss(line) for line in found.splitlines() if '"haproxy"' in line and peer_port(line) == port]


async def staged(directory: Path) -> dict[str, Any]:
    servers = {name: Backend(name, free_port()).start() for name in ("r1", "r2")}
    port = free_port()
    cfg = directory / "haproxy.cfg"
    cfg.write_text(config(port, {n: b.port for n, b in servers.items()}))
    master = HAProxyMaster(cfg, directory).start()
    try:
        warm = await KeepAliveClient(port).connect()
        served = [(await warm.get("/"))[1] for _ in range(4)]  # r1, r2, r1, r2: a pooled connection to each
        await warm.close()
        pooled = haproxy_sockets_to(servers["r1"].port)
        drop_ports({servers["r1"].port})
        clients = [await KeepAliveClient(port).connect() for _ in range(4)]
        started = time.monotonic()
        jobs = [asyncio.create_task(c.get("/", timeout=CLIENT_TIMEOUT_S)) for c in clients]
        await asyncio.sleep(3)
        during = haproxy_sockets_to(servers["r1"].port)
        answers = [(status, body, round(seconds, 3)) for status, body, seconds in await asyncio.gather(*jobs)]
        for c in clients:
            await c.close()
        return {"served": served, "pooled_before": pooled, "during": during, "answers": answers,
                "took": round(time.monotonic() - started, 3)}
    finally:
        master.stop()
        for backend in servers.values():
            backend.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    args.out.write_text(json.dumps(asyncio.run(staged(args.dir))))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
