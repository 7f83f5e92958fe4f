"""A Ray Serve-shaped rolling deployment, for tests/test_membership_e2e.py and bench/rolling.py.

One backend per app, a server per replica named after the replica, a `fallback` backup in
each; old workers keep their connections and keep taking requests on them (Ray Serve's
template: `close-spread-time`, `option idle-close-on-response`). Keep-alive clients send
requests back to back; everything on 127.0.0.1, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rigs.harness import KeepAliveClient

CONNECT_TIMEOUT_S = 0.5

HEAD = """\
global
    maxconn 4000
    hard-stop-after {hard_stop_s}s
    close-spread-time {hard_stop_s}s

defaults
    mode http
    timeout connect {connect_ms}ms
    timeout client 30s
    timeout server {server_s}s
    timeout http-keep-alive 30s
    option idle-close-on-response
    retries 2
    option redispatch
    default-server inter 300ms

frontend http_frontend
    bind 127.0.0.1:{front}
"""


def ray_config(
    front: int, apps: dict[str, list[tuple[str, int]]], fallback: int, server_s: int = 30, hard_stop_s: int = 60,
    log_to: Path | None = None,
) -> str:
    """`apps`: app -> [(replica name, port)]. /<app>... goes to the app's backend, anything
    else (demo/backend.py's /slow?ms=N) to the first app's. `log_to`: a unix datagram socket
    that gets HAProxy's log line of every request."""
    text = HEAD.format(
        front=front, connect_ms=int(CONNECT_TIMEOUT_S * 1000), server_s=server_s, hard_stop_s=hard_stop_s
    )
    if log_to is not None:
        text = text.replace("global\n", f"global\n    log {log_to} local0\n", 1)
        logged = "defaults\n    log global\n    option httplog\n"
        text = text.replace("defaults\n", logged, 1)
    text += "".join(f"    use_backend {app} if {{ path_beg /{app} }}\n" for app in apps)
    text += f"    default_backend {next(iter(apps))}\n"
    for app, replicas in apps.items():
        text += f"\nbackend {app}\n    balance leastconn\n"
        text += "".join(f"    server {name} 127.0.0.1:{port} check\n" for name, port in replicas)
        text += f"    server fallback 127.0.0.1:{fallback} backup\n"
    return text


class Load:
    """`clients` keep-alive connections, each cycling over the apps with requests back to
    back; a connection the proxy closes (`connection: close` from an old worker, or a failed
    request) is replaced by a new one. A request that meets its keep-alive connection closed
    before any byte of an answer is sent again once on a new one, as HTTP clients do for an
    idempotent request (counted in `retried`)."""

    def __init__(self, front: int, apps: list[str], clients: int, max_requests: int = 100_000,
                 max_seconds: float = 600) -> None:
        self.front, self.apps, self.clients = front, apps, clients
        self.max_requests, self.max_seconds = max_requests, max_seconds
        self.statuses: list[int] = []
        self.started: list[float] = []  # time.monotonic() each request was sent, beside its status
        self.errors: dict[int, str] = {}  # request index -> why it got no answer (status 0)
        self.retried = 0
        self.bodies: set[str] = set()
        self.slowest_s = 0.0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> Load:
        self._tasks = [asyncio.get_running_loop().create_task(self._run(i)) for i in range(self.clients)]
        return self

    async def _run(self, offset: int) -> None:
        deadline = time.monotonic() + self.max_seconds
        client = await KeepAliveClient(self.front).connect()
        i = offset
        try:
            while not self._stop.is_set() and len(self.statuses) < self.max_requests and time.monotonic() < deadline:
                sent = time.monotonic()
                path = f"/{self.apps[i % len(self.apps)]}"
                status, body, seconds = await client.get(path, timeout=10)
                if client.closed_before_answer:
                    self.retried += 1
                    await client.close()
                    client = await KeepAliveClient(self.front).connect()
                    status, body, again_s = await client.get(path, timeout=10)
                    seconds += again_s
                i += 1
                if status == 0:
                    self.errors[len(self.statuses)] = client.last_error or "?"
                self.statuses.append(status)
                self.started.append(sent)
                self.bodies.add(body)
                self.slowest_s = max(self.slowest_s, seconds)
                if status == 0 or client.closing:
                    await client.close()
                    client = await KeepAliveClient(self.front).connect()
                await asyncio.sleep(0.002)
        finally:
            await client.close()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    @property
    def non_200(self) -> int:
        return sum(1 for s in self.statuses if s != 200)
