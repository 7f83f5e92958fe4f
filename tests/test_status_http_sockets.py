"""The status app's sockets: a unix socket serves without a token and is removed at stop, and a
busy port is a one-line error."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rigs.status_server import Served, Server, get_json, start_status_server
from rigs.status_server import tcp as tcp  # a fixture
from rigs.status_server import token_file as token_file  # a fixture of tcp
from rigs.status_server import unix as unix  # a fixture
from rigs.status_state import CURRENT_PID, RecordingActions
from supervisor.settings import Settings
from supervisor.state import State
from supervisor.status.routes import build_app

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
