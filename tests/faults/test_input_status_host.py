"""Fault: any `Host` header was answered on the TCP status listener (issue 32). A web page can
make its own DNS name resolve to 127.0.0.1 (DNS rebinding) and read /status, /metrics and the
page from a browser on the node: backends, server addresses, the fleet's layout. The TCP
listener now answers only Host values that name it; a unix socket, which no browser reaches,
is not affected."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rigs.harness import free_port
from rigs.status_server import start_status_server
from rigs.status_state import RecordingActions, running_state
from supervisor.settings import Settings, StatusSettings
from supervisor.status.routes import build_app
from tests.support.faults import FAST_CONVERGE, serving, tcp_request

pytestmark = pytest.mark.haproxy

FOREIGN = {
    "a rebinding name": "rebind.example",
    "a rebinding name with the port": "rebind.example:{port}",
    "empty": "",
    "2,000 characters": "a" * 2000,
    "a name ending in a loopback name": "evil-localhost",
    "a name starting with 127.0.0.1": "127.0.0.1.rebind.example",
}
PATHS = ("/status", "/metrics", "/", "/healthz")


async def test_the_tcp_listener_answers_only_hosts_that_name_it(make):
    port = free_port()
    settings = {**FAST_CONVERGE, "status": {"listen": f"127.0.0.1:{port}", "allowed_hosts": ["node1.Example"]}}
    async with serving(make, settings, settled_s=None) as node:
        refused = {}
        for name, host in FOREIGN.items():
            for path in PATHS:
                code, body = await tcp_request(port, path, host.format(port=port))
                refused[(name, path)] = (code, body)
        allowed = {}
        for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}",
                     "node1.example", f"NODE1.example:{port}", "10.1.2.3:9180"):
            allowed[host] = await tcp_request(port, "/status", host)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
        no_host = await reader.read()
        writer.close()
    leaks = {k: v for k, v in refused.items() if v[0] != 421 or b"worker" in v[1] or b"haproxy_supervisor" in v[1]}
    assert not leaks, leaks
    assert all(b'"error"' in body and b"status.allowed_hosts" in body for _, body in refused.values())
    assert {host: code for host, (code, _) in allowed.items()} == dict.fromkeys(allowed, 200)
    assert all(b'"worker"' in body for _, body in allowed.values())
    assert no_host.startswith(b"HTTP/1.0 200"), no_host[:200]  # HTTP/1.0 without Host: a check, no browser
    assert not node.loop.failures, node.loop.failures[:5]


async def test_a_unix_socket_listener_answers_any_host(rundir: Path):
    state = running_state()
    settings = Settings(status=StatusSettings(listen=f"unix:{rundir / 'status.sock'}"))
    runner = await start_status_server(build_app(state, settings, RecordingActions(state)), settings.status.listen)
    try:
        reader, writer = await asyncio.open_unix_connection(str(rundir / "status.sock"))
        writer.write(b"GET /status HTTP/1.1\r\nHost: rebind.example\r\nConnection: close\r\n\r\n")
        answer = await reader.read()
        writer.close()
    finally:
        await runner.cleanup()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
