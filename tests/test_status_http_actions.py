"""The status app over real TCP: the actions (reload, mark and unmark dead) and their
refusals: the token, bad names, big bodies, a missing or unreadable token file, a failed action."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from yarl import URL

from rigs.harness import free_port
from rigs.status_server import AUTH, TOKEN, Served, Server, get_json
from rigs.status_server import tcp as tcp  # a fixture
from rigs.status_server import token_file as token_file  # a fixture, and one of tcp

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
        writer.write(b"POST /reload HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer t\xf6k\xe9n\xff\r\n"
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
