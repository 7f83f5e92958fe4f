"""The status app over real sockets: every endpoint, the refusals, TCP and unix, and the `status` CLI.

The server is the real aiohttp server on 127.0.0.1:<free port> or on a unix socket in a
short directory; requests are real HTTP. State is filled in as a running daemon's, and
`actions` records what the operator asked for.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from supervisor.settings import Settings, StatusSettings
from supervisor.state import State
from supervisor.status.listener import start_status_server
from supervisor.status.routes import build_app
from tests.support.harness import free_port
from tests.support.status_state import CURRENT_PID, OLD_PIDS, RecordingActions, running_state
from tests.test_status import documented_schema_keys, key_paths

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Served:
    base: str
    state: State
    actions: RecordingActions
    socket_path: Path | None = None

    def session(self) -> aiohttp.ClientSession:
        connector = aiohttp.UnixConnector(path=str(self.socket_path)) if self.socket_path else None
        return aiohttp.ClientSession(self.base, connector=connector, timeout=aiohttp.ClientTimeout(total=10))


@dataclass
class Server:
    """Start the status app on a real listener; stop it in `stop`."""

    listen: str
    token_file: Path | None
    reload_result: str | None = "ok"

    async def start(self) -> Served:
        self.state = running_state()
        self.actions = RecordingActions(self.state, self.reload_result)  # type: ignore[arg-type]
        settings = Settings(status=StatusSettings(listen=self.listen, token_file=self.token_file))
        self.runner = await start_status_server(build_app(self.state, settings, self.actions), self.listen)
        if self.listen.startswith("unix:"):
            return Served("http://localhost", self.state, self.actions, Path(self.listen[5:]))
        return Served(f"http://{self.listen}", self.state, self.actions)

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
async def tcp(token_file: Path) -> AsyncIterator[Served]:
    server = Server(f"127.0.0.1:{free_port()}", token_file)
    served = await server.start()
    try:
        yield served
    finally:
        await server.stop()


@pytest.fixture
async def unix(rundir: Path) -> AsyncIterator[Served]:
    server = Server(f"unix:{rundir / 'status.sock'}", None)
    served = await server.start()
    try:
        yield served
    finally:
        await server.stop()


async def get_json(session: aiohttp.ClientSession, method: str, path: str, **kwargs) -> tuple[int, dict]:
    async with session.request(method, path, **kwargs) as response:
        assert response.content_type == "application/json", (response.status, await response.text())
        return response.status, await response.json()


# ---------------------------------------------------------------- reads


async def test_status_over_tcp(tcp: Served):
    async with tcp.session() as session, session.get("/status") as response:
        assert response.status == 200
        document = await response.json()
    assert key_paths(document) == documented_schema_keys()
    assert document["worker"]["pid"] == CURRENT_PID
    assert [w["pid"] for w in document["old_workers"]] == list(OLD_PIDS)
    assert document["supervisor"]["pid"] == os.getpid()
    assert 3720 < document["supervisor"]["uptime_s"] < 3800


async def test_metrics_over_tcp(tcp: Served):
    async with tcp.session() as session, session.get("/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("haproxy_supervisor_up", ())] == 1
    assert samples[("haproxy_supervisor_reloads_total", (("result", "failed"),))] == 1
    assert samples[("haproxy_supervisor_old_workers", ())] == 2
    assert samples[("haproxy_supervisor_steered_servers", ())] == 3
    assert samples[("haproxy_supervisor_push_duration_seconds_count", ())] == 5
    for name in (
        "haproxy_supervisor_up", "haproxy_supervisor_reloads", "haproxy_supervisor_runtime_applies",
        "haproxy_supervisor_config_generation", "haproxy_supervisor_old_workers",
        "haproxy_supervisor_old_worker_oldest_age_seconds", "haproxy_supervisor_steered_servers",
        "haproxy_supervisor_push_duration_seconds", "haproxy_supervisor_push_failures",
        "haproxy_supervisor_master_restarts",
    ):
        assert families[name].documentation, name
        assert f"# TYPE {name}" in text

    # Metrics follow State from one scrape to the next.
    tcp.state.old_workers.pop(OLD_PIDS[0])
    async with tcp.session() as session, session.get("/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["haproxy_supervisor_old_workers"].samples[0].value == 1


async def test_healthz_follows_the_master(tcp: Served):
    async with tcp.session() as session:
        assert await get_json(session, "GET", "/healthz") == (200, {"status": "ok"})
        tcp.state.master_up = False
        assert await get_json(session, "GET", "/healthz") == (503, {"error": "HAProxy master is not running"})
        tcp.state.master_up = True
        assert (await get_json(session, "GET", "/healthz"))[0] == 200


async def test_readyz_follows_the_current_worker(tcp: Served):
    async with tcp.session() as session:
        assert await get_json(session, "GET", "/readyz") == (200, {"status": "ready"})
        good = tcp.state.last_good_sha256
        tcp.state.last_good_sha256 = "0" * 64  # e.g. the last good config failed to load
        assert await get_json(session, "GET", "/readyz") == (
            503, {"error": "the current worker does not run the last good config"}
        )
        tcp.state.last_good_sha256 = good
        tcp.state.master_up = False
        assert await get_json(session, "GET", "/readyz") == (503, {"error": "HAProxy master is not running"})


async def test_page_over_tcp(tcp: Served):
    async with tcp.session() as session, session.get("/") as response:
        assert response.status == 200
        assert response.content_type == "text/html"
        assert "default-src 'none'" in response.headers["Content-Security-Policy"]
        page = await response.text()
    assert f">{CURRENT_PID}<" in page and all(f">{pid}<" in page for pid in OLD_PIDS)
    assert "echo/echo_r1" in page


async def test_unknown_paths_and_methods_answer_json(tcp: Served):
    async with tcp.session() as session:
        assert await get_json(session, "GET", "/nope") == (404, {"error": "no such endpoint: GET /nope"})
        status, body = await get_json(session, "GET", "/reload")
        assert status == 405 and "POST" in body["error"]
        assert tcp.actions.calls == []


# ---------------------------------------------------------------- actions over TCP


async def test_reload_needs_the_token(tcp: Served):
    async with tcp.session() as session:
        status, body = await get_json(session, "POST", "/reload")
        assert status == 403 and "Authorization: Bearer" in body["error"]
        async with session.post("/reload", headers={"Authorization": "Bearer wrong"}) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert await response.json() == {"error": "wrong bearer token"}
        status, _ = await get_json(session, "POST", "/reload", headers={"Authorization": f"Basic {TOKEN}"})
        assert status == 401
        assert tcp.actions.calls == []  # none of the refused requests reached the daemon

        status, body = await get_json(session, "POST", "/reload", headers=AUTH)
    assert status == 200
    assert body["reload"]["result"] == "ok" and body["reload"]["duration_ms"] == 12.5
    assert tcp.actions.calls == [("reload_now",)]


async def test_a_token_that_is_not_ascii_is_refused_not_crashed(tcp: Served):
    # Raw bytes on the socket: clients may send any octets in a header.
    host, port = tcp.base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /reload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\xf6k\xe9n\xff\r\n"
                     b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert tcp.actions.calls == []


async def test_mark_and_unmark_dead(tcp: Served):
    async with tcp.session() as session:
        status, body = await get_json(session, "POST", "/servers/wide/wide_r3/dead", headers=AUTH)
        assert (status, body) == (200, {"server": "wide/wide_r3", "operator_dead": True})
        _, document = await get_json(session, "GET", "/status")
        assert "wide/wide_r3" in document["operator_dead"] and "wide/wide_r3" in document["dead_servers"]

        status, body = await get_json(session, "DELETE", "/servers/wide/wide_r3/dead", headers=AUTH)
        assert (status, body) == (200, {"server": "wide/wide_r3", "operator_dead": False})
        _, document = await get_json(session, "GET", "/status")
        assert "wide/wide_r3" not in document["dead_servers"]
    assert tcp.actions.calls == [("mark_dead", "wide", "wide_r3"), ("unmark_dead", "wide", "wide_r3")]


async def test_a_server_only_an_old_worker_runs_can_be_marked(tcp: Served):
    # app/app1 is in generation 1 only, which an old worker still runs: exactly the kind of
    # server that black-holes traffic there.
    async with tcp.session() as session:
        status, _ = await get_json(session, "POST", "/servers/app/app1/dead", headers=AUTH)
    assert status == 200


async def test_unknown_server_is_404(tcp: Served):
    async with tcp.session() as session:
        status, body = await get_json(session, "POST", "/servers/echo/echo_r9/dead", headers=AUTH)
        assert (status, body) == (404, {"error": "no server echo/echo_r9 in any config HAProxy runs"})
        status, _ = await get_json(session, "DELETE", "/servers/nope/echo_r1/dead", headers=AUTH)
        assert status == 404
        # Unauthenticated callers learn nothing about which servers exist.
        status, _ = await get_json(session, "POST", "/servers/echo/echo_r9/dead")
        assert status == 403
    assert tcp.actions.calls == []


async def test_a_mark_can_be_cleared_after_its_server_left_every_config(tcp: Served):
    tcp.state.operator_dead.add("gone/gone_r1")
    async with tcp.session() as session:
        status, _ = await get_json(session, "DELETE", "/servers/gone/gone_r1/dead", headers=AUTH)
    assert status == 200 and tcp.actions.calls == [("unmark_dead", "gone", "gone_r1")]


@pytest.mark.parametrize("path", ["/servers/echo/echo_r1%3Bshutdown/dead", "/servers/ech%20o/echo_r1/dead",
                                  "/servers/echo/echo_r1%0Ashow%20info/dead"])
async def test_bad_names_are_400(tcp: Served, path: str):
    url = URL(tcp.base + path, encoded=True)  # sent as written: %3B, %20 and %0A reach the server
    async with tcp.session() as session, session.post(url, headers=AUTH) as response:
        assert response.status == 400
        body = await response.json()
    assert body["error"].startswith("invalid ") and "only letters, digits" in body["error"]
    assert tcp.actions.calls == []


async def test_bodies_over_64_kib_are_413(tcp: Served):
    async with tcp.session() as session:
        status, body = await get_json(session, "POST", "/reload", headers=AUTH, data=b"x" * (70 * 1024))
        assert (status, body) == (413, {"error": "request body larger than 65536 bytes"})
        # Without a Content-Length (chunked) the limit holds too.
        async def chunks():
            for _ in range(70):
                yield b"y" * 1024

        status, _ = await get_json(session, "POST", "/servers/echo/echo_r1/dead", headers=AUTH, data=chunks())
        assert status == 413
        # A small body is fine.
        status, _ = await get_json(session, "POST", "/reload", headers=AUTH, data=b"{}")
        assert status == 200
    assert tcp.actions.calls == [("reload_now",)]


async def test_no_token_file_refuses_actions_over_tcp():
    server = Server(f"127.0.0.1:{free_port()}", None)
    served = await server.start()
    try:
        async with served.session() as session:
            for method, path in (("POST", "/reload"), ("POST", "/servers/echo/echo_r1/dead"),
                                 ("DELETE", "/servers/echo/echo_r1/dead")):
                status, body = await get_json(session, method, path, headers=AUTH)
                assert status == 403 and "no status.token_file is configured" in body["error"], body
            # Reads need no token.
            assert (await get_json(session, "GET", "/healthz"))[0] == 200
    finally:
        await server.stop()
    assert served.actions.calls == []


async def test_unreadable_token_file_refuses_and_is_logged(tmp_path: Path, caplog):
    missing = tmp_path / "no-such-token"
    server = Server(f"127.0.0.1:{free_port()}", missing)
    served = await server.start()
    try:
        assert f"status.token_file {missing}: cannot read" in caplog.text
        async with served.session() as session:
            status, body = await get_json(session, "POST", "/reload", headers=AUTH)
    finally:
        await server.stop()
    assert status == 403 and "could not be read" in body["error"]
    assert served.actions.calls == []


@pytest.mark.parametrize(("result", "status"), [("failed", 500), ("invalid", 500), ("skipped_unchanged", 200),
                                                (None, 202)])
async def test_reload_answer_follows_the_result(token_file: Path, result: str | None, status: int):
    server = Server(f"127.0.0.1:{free_port()}", token_file, reload_result=result)
    served = await server.start()
    try:
        async with served.session() as session:
            answer, body = await get_json(session, "POST", "/reload", headers=AUTH)
    finally:
        await server.stop()
    assert answer == status
    if status == 500:
        assert body["error"].startswith(f"reload {result}") and body["reload"]["result"] == result
    if status == 202:
        assert body == {"reload": "queued"}


async def test_an_action_that_raises_is_a_json_500(tcp: Served):
    async def broken() -> None:
        raise RuntimeError("master CLI went away")

    tcp.actions.reload_now = broken  # type: ignore[method-assign]
    async with tcp.session() as session:
        status, body = await get_json(session, "POST", "/reload", headers=AUTH)
        assert (status, body) == (500, {"error": "internal error: RuntimeError: master CLI went away"})
        assert (await get_json(session, "GET", "/healthz"))[0] == 200  # still serving


# ---------------------------------------------------------------- unix socket


async def test_unix_socket_serves_and_needs_no_token(unix: Served):
    assert stat.S_IMODE(unix.socket_path.stat().st_mode) == 0o660
    async with unix.session() as session:
        status, document = await get_json(session, "GET", "/status")
        assert status == 200 and document["worker"]["pid"] == CURRENT_PID
        async with session.get("/metrics") as response:
            assert response.status == 200 and "haproxy_supervisor_up 1.0" in await response.text()
        async with session.get("/") as response:
            assert response.status == 200
        assert (await get_json(session, "GET", "/healthz"))[0] == 200
        assert (await get_json(session, "GET", "/readyz"))[0] == 200
        # No token and no token file: the socket's mode decided, so actions go through.
        assert (await get_json(session, "POST", "/reload"))[0] == 200
        assert (await get_json(session, "POST", "/servers/echo/echo_r1/dead"))[0] == 200
        assert (await get_json(session, "DELETE", "/servers/echo/echo_r1/dead"))[0] == 200
        # The other refusals are the same as over TCP.
        assert (await get_json(session, "POST", "/servers/echo/nope/dead"))[0] == 404
        assert (await get_json(session, "POST", "/servers/echo/a%20b/dead"))[0] == 400
        assert (await get_json(session, "POST", "/reload", data=b"z" * (70 * 1024)))[0] == 413
    assert unix.actions.calls == [("reload_now",), ("mark_dead", "echo", "echo_r1"), ("unmark_dead", "echo", "echo_r1")]


async def test_unix_socket_file_is_removed_at_stop(rundir: Path):
    server = Server(f"unix:{rundir / 'status.sock'}", None)
    served = await server.start()
    assert served.socket_path.exists()
    await server.stop()
    assert not served.socket_path.exists()


async def test_a_busy_port_is_a_one_line_error(tcp: Served):
    from supervisor.status.listener import StatusServerError

    listen = tcp.base.removeprefix("http://")
    with pytest.raises(StatusServerError, match=rf"^status.listen {listen}: .*address already in use"):
        await start_status_server(build_app(State(), Settings(), RecordingActions(State())), listen)


# ---------------------------------------------------------------- the `status` command


async def run_status_cli(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    """The CLI as a child process; awaited, so this event loop keeps serving it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor", "status", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, stdout.decode(), stderr.decode()


async def test_status_command_table(tcp: Served):
    code, out, err = await run_status_cli("--url", tcp.base)
    assert (code, err) == (0, "")
    assert f"pid {CURRENT_PID}  generation 3" in out
    assert "old workers (2)" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(tuple(map(str, OLD_PIDS)))]
    assert [row[0] for row in rows] == [str(p) for p in OLD_PIDS]
    assert "echo/echo_r1, highscale/highscale_r2" in out
    assert "dead servers (3): app/app1, echo/echo_r1, highscale/highscale_r2 (operator)" in out


async def test_status_command_json(tcp: Served):
    code, out, _ = await run_status_cli("--url", tcp.base, "--json")
    assert code == 0
    document = json.loads(out)
    assert key_paths(document) == documented_schema_keys()
    assert document["worker"]["pid"] == CURRENT_PID
    assert [w["steered"] for w in document["old_workers"]] == [
        sorted(tcp.state.old_workers[pid].steered) for pid in OLD_PIDS
    ]


async def test_status_command_over_unix_socket_from_settings(unix: Served, tmp_path: Path):
    settings = tmp_path / "settings.yaml"
    settings.write_text(f"status:\n  listen: unix:{unix.socket_path}\n")
    code, out, err = await run_status_cli("--config", str(settings))
    assert (code, err) == (0, "")
    assert f"pid {CURRENT_PID}" in out
    code, out, _ = await run_status_cli("--url", f"unix:{unix.socket_path}", "--json")
    assert code == 0 and json.loads(out)["worker"]["pid"] == CURRENT_PID


async def test_status_command_when_the_daemon_is_unreachable(rundir: Path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = await run_status_cli("--url", url)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"haproxy-supervisor: cannot reach the daemon at {url}: ")
    code, out, err = await run_status_cli("--url", f"unix:{rundir / 'absent.sock'}", "--json")
    assert code == 1 and out == "" and err.count("\n") == 1 and "cannot reach the daemon" in err


async def test_status_command_when_the_daemon_answers_an_error(tcp: Served):
    code, _, err = await run_status_cli("--url", tcp.base + "/nope/status")
    assert code == 1 and err.count("\n") == 1 and "answered HTTP 404" in err

