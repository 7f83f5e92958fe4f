"""The hand-off against the real HAProxy, under the daemon's reloader and steering: an old
worker whose servers for a backend are dead serves its held connection's request through the
current worker, which sees the client's address; a backend with a rule of its own is not
handed off; and without the hand-off the same request fails."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigs.harness import VanishedNode, free_port, haproxy_binary
from rigs.ray_driver import App, ray_config
from rigs.supervised import supervised
from supervisor.effective import build_effective, prepare_runtime_dir, write_slot_table
from supervisor.haproxy.handoff import is_handed_off, map_path
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings
from supervisor.steering.mapdiff import map_entries

pytestmark = pytest.mark.haproxy

CLIENT_ADDRESS = "127.0.0.2"  # not the address HAProxy connects from: the client's own

CONFIG = """\
global
    hard-stop-after 60s
    close-spread-time infinite

defaults
    mode http
    timeout connect 500ms
    timeout client 30s
    timeout server 30s
    option idle-close-on-response
    retries 3
    option redispatch 1

frontend fe
    bind 127.0.0.1:{front}
    option forwardfor
    use_backend ruled if {{ path_beg /ruled }}
    use_backend other if {{ path_beg /other }}
    default_backend app

backend app
{app_rules}{app}
backend ruled
    http-request set-header x-ruled 1
{ruled}
backend other
{other}"""


class _Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection: no pooled connection outlives a kill

    def do_GET(self) -> None:
        seen = {
            "name": self.server.name,  # type: ignore[attr-defined]
            "xff": self.headers.get_all("x-forwarded-for") or [],
            "src": self.headers.get("x-client-src"),
            "handoff_header": self.headers.get("x-hs-backend"),
        }
        body = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class EchoServer:
    """An HTTP server in a thread that answers with its name and the headers it was given."""

    def __init__(self, name: str) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
        self.server.name = name  # type: ignore[attr-defined]
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def kill(self) -> None:
        """Its port refuses connections from now on."""
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def echo_servers(*names: str) -> Iterator[dict[str, EchoServer]]:
    servers = {name: EchoServer(name) for name in names}
    try:
        yield servers
    finally:
        for server in servers.values():
            with contextlib.suppress(OSError):
                server.kill()


class HeldClient:
    """A keep-alive connection from CLIENT_ADDRESS."""

    def __init__(self, front: int) -> None:
        self.front = front
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> HeldClient:
        self.reader, self.writer = await asyncio.open_connection(
            "127.0.0.1", self.front, local_addr=(CLIENT_ADDRESS, 0)
        )
        return self

    async def get(self, path: str = "/") -> tuple[int, dict]:
        """(status, what the server saw); (0, {}) when the connection closed without an answer."""
        assert self.reader is not None and self.writer is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\nhost: test\r\n\r\n".encode())
        async with asyncio.timeout(10):
            try:
                head = (await self.reader.readuntil(b"\r\n\r\n")).decode()
            except (asyncio.IncompleteReadError, ConnectionError):
                return 0, {}
            lines = head.split("\r\n")
            status = int(lines[0].split()[1])
            length = next(
                (int(v) for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length"), 0
            )
            body = await self.reader.readexactly(length)
        try:
            return status, json.loads(body) if status == 200 else {}
        except ValueError:
            return status, {}

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


def rendered(front: int, servers: dict[str, EchoServer], app: list[str], app_rules: str = "") -> str:
    def lines(names: list[str]) -> str:
        return "".join(f"    server {n} 127.0.0.1:{servers[n].port}\n" for n in names)

    return CONFIG.format(front=front, app=lines(app), app_rules=app_rules, ruled=lines(app), other=lines(["c"]))


@contextlib.asynccontextmanager
async def incident(
    rundir: Path, hand_off: bool, old_app: tuple[str, ...] = ("a", "b"), new_app: tuple[str, ...] = ("c",)
):
    """HAProxy whose first worker holds a client for `/` and one for `/ruled`, made old by a
    reload to a config whose `app` has `new_app` (and tells the client's address it saw) and
    whose other backends have only c; a and b are then killed. Yields the vanished nodes'
    setter too: `vanish(name)` makes connects to that server hang."""
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir),
        old_workers=OldWorkerSettings(poll_interval_ms=100, hand_off=hand_off),
    )
    front = free_port()
    with echo_servers("a", "b", "c", "x") as servers:
        async with supervised(settings, rendered(front, servers, list(old_app))) as sup:
            held = {path: await HeldClient(front).connect() for path in ("/", "/ruled")}
            try:
                for path, client in held.items():
                    status, seen = await client.get(path)
                    assert status == 200 and seen["name"] in old_app, (path, status, seen)
                old_pid = sup.current_pid
                src_rule = "    http-request set-header x-client-src %[src]\n"
                await sup.reload(rendered(front, servers, list(new_app), app_rules=src_rule))
                assert sup.master.worker_pids()[1] == [old_pid]
                servers["a"].kill()
                servers["b"].kill()
                await sup.wait_steered([old_pid])
                yield sup, old_pid, held, servers
            finally:
                for client in held.values():
                    await client.close()


async def test_old_worker_hands_its_request_to_the_current_worker(rundir):
    async with incident(rundir, hand_off=True) as (sup, old_pid, held, _):
        await sup.until(lambda: sup.state.old_workers[old_pid].handed_off == 2, what="the hand-off confirmed")
        handoff_map = map_entries(await sup.cli.on(old_pid, f"show map {map_path(sup.settings.haproxy.runtime_dir)}"))
        assert handoff_map == {"app": "1", "other": "1"}  # `ruled` has a rule of its own
        for _ in range(2):
            status, seen = await held["/"].get("/")
            # Only the new config has c; the client's address came along in PROXY v2, and
            # X-Forwarded-For was added once, by the old worker's frontend.
            assert (status, seen) == (
                200,
                {"name": "c", "xff": [CLIENT_ADDRESS], "src": CLIENT_ADDRESS, "handoff_header": None},
            )
        status, seen = await held["/ruled"].get("/ruled")
        assert status == 503, seen  # not handed off: the old worker has no live server for it
        # A new connection reaches the current worker as before.
        fresh = await HeldClient(held["/"].front).connect()
        try:
            status, seen = await fresh.get("/")
            assert (status, seen["name"], seen["xff"]) == (200, "c", [CLIENT_ADDRESS])
        finally:
            await fresh.close()
        current = sup.current_pid
        assert map_entries(await sup.cli.on(current, f"show map {map_path(sup.settings.haproxy.runtime_dir)}")) == {}
        # The hand-off's server is no server of the daemon's.
        assert not any("_hs_current" in key for key in sup.state.dead_servers)


async def test_without_the_hand_off_the_old_worker_fails_the_request(rundir):
    async with incident(rundir, hand_off=False) as (sup, old_pid, held, _):
        status, _ = await held["/"].get("/")
        assert status == 503
        assert sup.state.old_workers[old_pid].handed_off == 0


async def test_a_restarted_daemon_hands_off_the_old_workers_it_finds(rundir):
    async with incident(rundir, hand_off=True) as (sup, old_pid, held, _):
        path = map_path(sup.settings.haproxy.runtime_dir)
        await sup.until(lambda: sup.state.old_workers[old_pid].handed_off == 2, what="the hand-off confirmed")
        assert (await sup.cli.on(old_pid, f"clear map {path}")).strip() == ""
        await sup.restart()
        await sup.until(
            lambda: sup.state.old_workers.get(old_pid) and sup.state.old_workers[old_pid].handed_off == 2,
            what="the hand-off pushed again",
        )
        assert map_entries(await sup.cli.on(old_pid, f"show map {path}")) == {"app": "1", "other": "1"}
        status, seen = await held["/"].get("/")
        assert (status, seen["name"]) == (200, "c")


def test_a_ray_shaped_config_with_the_hand_off_passes_haproxy_check(tmp_path):
    apps = [App("app1", ["127.0.0.1:18001", "127.0.0.1:18002"]), App("app2", ["127.0.0.1:18003"])]
    rendered = ray_config(tmp_path, free_port(), free_port(), free_port(), apps, None, prometheus=False)
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path), old_workers=OldWorkerSettings(hand_off=True))
    prepare_runtime_dir(settings)
    effective = build_effective(settings, rendered)
    assert {"app1", "app2"} <= {s.name for s in effective.effective_model.backends() if is_handed_off(s)}
    write_slot_table(effective.slot_table)
    config = tmp_path / "check.cfg"
    config.write_text(effective.text)
    checked = subprocess.run([haproxy_binary(), "-c", "-f", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


NAMED_DEFAULTS = """\
defaults ruled
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
    http-request set-header x-d 1

backend by_ruled from ruled
    server a 127.0.0.1:1

defaults plain
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s

backend by_plain
    server a 127.0.0.1:1

frontend fe
    bind 127.0.0.1:{front}
    use_backend by_ruled if {{ path_beg /r }}
    default_backend by_plain
"""


# The same sections, the defaults with rules last: the hand-off frontend would go under it.
RULED_LAST = NAMED_DEFAULTS.replace("frontend fe\n", "frontend fe from plain\n").split("\n\n")
RULED_LAST = "\n\n".join([RULED_LAST[2], RULED_LAST[3], RULED_LAST[0], RULED_LAST[1], RULED_LAST[4]])


@pytest.mark.parametrize(("text", "handed_off"), [(NAMED_DEFAULTS, {"by_plain"}), (RULED_LAST, set())])
def test_a_config_with_rules_in_a_named_defaults_keeps_passing_haproxy_check(tmp_path, text, handed_off):
    """The backend under the defaults with rules is not handed off, and the hand-off frontend
    goes in only where the last defaults has no rules (HAProxy refuses a frontend and a backend
    under the same defaults with rules)."""
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path), old_workers=OldWorkerSettings(hand_off=True))
    prepare_runtime_dir(settings)
    effective = build_effective(settings, text.format(front=free_port()))
    assert {s.name for s in effective.effective_model.backends() if is_handed_off(s)} == handed_off
    write_slot_table(effective.slot_table)
    config = tmp_path / "check.cfg"
    config.write_text(effective.text)
    checked = subprocess.run([haproxy_binary(), "-c", "-f", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("hand_off", [True, False])
async def test_a_retry_goes_only_to_servers_the_current_worker_sees_alive(rundir, hand_off):
    """The retry hole: the only server the old worker is steered to (x, in both configs)
    vanishes; its retries would go to a and b, replaced and refused, which it still sees UP.
    Handed off, the current worker retries over x and c instead."""
    async with incident(rundir, hand_off, old_app=("a", "b", "x"), new_app=("x", "c")) as (sup, old_pid, held, servers):
        if hand_off:
            await sup.until(lambda: sup.state.old_workers[old_pid].handed_off == 2, what="the hand-off confirmed")
        servers["x"].kill()
        node = VanishedNode(servers["x"].port)
        try:
            assert node.connect_hangs()
            started = time.monotonic()
            status, seen = await held["/"].get("/")
            if hand_off:
                # At most one connect timeout (500 ms) to x in the current worker, then c.
                assert (status, seen["name"]) == (200, "c")
                assert time.monotonic() - started < 2
            else:
                # Its retries met only dead servers: a 503, or the connection closed unanswered.
                assert status in (0, 503), (status, seen)
        finally:
            node.close()


async def test_after_a_second_reload_the_request_goes_to_the_worker_current_then(rundir):
    """The worker the first hand-off reached is made old in turn: the held client's next
    request must reach the newest worker (server x), not the one it was handed to before,
    whose `app` (with a rule of its own) it does not hand off and serves from c. It does: the
    old worker keeps no connection to the hand-off socket between requests."""
    async with incident(rundir, hand_off=True) as (sup, old_pid, held, servers):
        await sup.until(lambda: sup.state.old_workers[old_pid].handed_off == 2, what="the hand-off confirmed")
        assert (await held["/"].get("/"))[1]["name"] == "c"
        src_rule = "    http-request set-header x-client-src %[src]\n"
        await sup.reload(rendered(held["/"].front, servers, ["x"], app_rules=src_rule))
        await sup.wait_steered([old_pid])
        await sup.until(lambda: sup.state.old_workers[old_pid].handed_off == 2, what="still handed off")
        for _ in range(2):
            status, seen = await held["/"].get("/")
            assert (status, seen["name"]) == (200, "x")
