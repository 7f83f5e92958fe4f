"""The status listener against hostile clients (issue 13, items 7 and 11), over real sockets:
header and body timeouts, the connection limit, requests aiohttp's parser refuses, clients
that leave mid-body. Each answer is `{"error": ...}` JSON and nothing logs a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import time
from collections.abc import AsyncIterator

import pytest

from rigs.harness import free_port
from rigs.status_server import start_status_server
from rigs.status_state import RecordingActions, running_state
from supervisor.haproxy.answers import validate_name
from supervisor.settings import Settings, StatusSettings
from supervisor.status.routes import build_app

LIMITS = StatusSettings(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=5)
# How long a test waits to see a connection closed: the timeouts above plus a loaded machine.
CLOSED_WITHIN_S = 4.0


@pytest.fixture
async def port(caplog) -> AsyncIterator[int]:
    caplog.set_level(logging.DEBUG)
    state = running_state()
    port = free_port()
    settings = Settings(status=LIMITS)
    runner = await start_status_server(build_app(state, settings, RecordingActions(state)), f"127.0.0.1:{port}", LIMITS)
    try:
        yield port
    finally:
        await runner.cleanup()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def closed_by_server(reader: asyncio.StreamReader, within: float = CLOSED_WITHIN_S) -> bool:
    """True when the server ends the connection within `within` seconds (whatever it sent first)."""
    deadline = time.monotonic() + within
    with contextlib.suppress(ConnectionError):
        while (left := deadline - time.monotonic()) > 0:
            try:
                if not await asyncio.wait_for(reader.read(65536), left):
                    return True
            except TimeoutError:
                return False
        return False
    return True


async def exchange(port: int, raw: bytes, timeout: float = 5.0) -> tuple[int, dict]:
    """Send raw bytes, read the whole answer (the server closes after an error): (status, JSON body)."""
    reader, writer = await connect(port)
    try:
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), answer[:500]
    return status, json.loads(body)


async def healthz(port: int) -> int:
    status, _ = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: [::1]\r\nConnection: close\r\n\r\n")
    return status


def no_traceback(caplog) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [(r.name, r.getMessage()) for r in bad]


# ---------------------------------------------------------------- header timeout (item 7)


@pytest.mark.parametrize(
    "sent", [b"", b"GET /healthz HTTP/1.1\r\nHost: [::1]\r\n"], ids=["nothing", "half the headers"]
)
async def test_a_request_whose_headers_never_finish_is_closed(port: int, sent: bytes, caplog):
    reader, writer = await connect(port)
    writer.write(sent)
    assert await closed_by_server(reader)
    writer.close()
    assert await healthz(port) == 200  # control: a whole request on a new connection is served
    no_traceback(caplog)


async def test_trickled_headers_are_closed_too(port: int):
    reader, writer = await connect(port)
    started = time.monotonic()
    closed = False
    for byte in b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 200:
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            closed = True
            break
        if reader.at_eof() or time.monotonic() - started > CLOSED_WITHIN_S:
            break
        await asyncio.sleep(0.02)
    closed = closed or await closed_by_server(reader, 0.5)
    writer.close()
    assert closed, "a client trickling its headers one byte at a time kept the connection"


async def test_a_keep_alive_connection_is_served_then_times_out_idle(port: int):
    reader, writer = await connect(port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: [::1]\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    assert await closed_by_server(reader)
    writer.close()


# ---------------------------------------------------------------- connection limit (item 7)


async def test_at_the_limit_the_oldest_idle_connection_makes_room(port: int, caplog):
    idle = [await connect(port) for _ in range(LIMITS.max_connections)]
    await asyncio.sleep(0.05)
    for _ in range(20):  # a flood well past the limit: still one warning
        _, writer = await connect(port)
        writer.close()
    assert await healthz(port) == 200
    assert await closed_by_server(idle[0][0], 1.0)
    for _, writer in idle:
        writer.close()
    warnings = [r for r in caplog.records if "status.max_connections" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    no_traceback(caplog)


# ---------------------------------------------------------------- bodies (items 7 and 11)


async def test_a_huge_content_length_is_413_at_once(port: int):
    started = time.monotonic()
    status, body = await exchange(
        port, b"POST /reload HTTP/1.1\r\nHost: [::1]\r\nContent-Length: 1000000000000\r\n\r\n"
    )
    assert status == 413 and "larger than" in body["error"]
    assert time.monotonic() - started < LIMITS.body_timeout_s + 2.5  # answered, not left open


async def test_a_body_that_stops_coming_is_408(port: int):
    status, body = await exchange(
        port, b"POST /reload HTTP/1.1\r\nHost: [::1]\r\nContent-Length: 100\r\n\r\n0123456789"
    )
    assert status == 408 and "not received within" in body["error"]


async def test_a_client_leaving_mid_body_logs_no_traceback(port: int, caplog):
    _, writer = await connect(port)
    writer.write(b"POST /reload HTTP/1.1\r\nHost: [::1]\r\nContent-Length: 1000\r\n\r\n0123456789")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.transport.abort()
    await asyncio.sleep(0.3)
    assert await healthz(port) == 200
    no_traceback(caplog)


# ---------------------------------------------------------------- what aiohttp's parser refuses (item 11)


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /healthz HTTP/1.1\r\nHost: [::1]\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        b"FOO /healthz HTTP/1.1\r\nHost: [::1]\r\n\r\n",
        b"POST /reload HTTP/1.1\r\nHost: [::1]\r\nContent-Length: -1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: [::1]\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["header over 8 KiB", "method FOO", "negative Content-Length", "bad chunk"],
)
async def test_requests_the_parser_refuses_get_json_and_no_traceback(port: int, raw: bytes, caplog):
    status, body = await exchange(port, raw)
    assert 400 <= status < 500 and isinstance(body["error"], str) and body["error"], (status, body)
    no_traceback(caplog)


# ---------------------------------------------------------------- names (item 11)


@pytest.mark.parametrize("name", ["s1\n", "s1\r\n", "s1\nshow info"])
def test_a_name_with_a_trailing_newline_is_refused(name: str):
    with pytest.raises(ValueError, match="invalid server name"):
        validate_name("server", name)


def test_control_a_plain_name_passes():
    assert validate_name("server", "s1.a:b-c_d") == "s1.a:b-c_d"


# ---------------------------------------------------------------- out of descriptors (item 7)


async def test_accept_out_of_descriptors_is_one_line_not_a_traceback_each(port: int, caplog):
    # What asyncio's accept loop reports when accept() fails with EMFILE (selector_events).
    loop = asyncio.get_running_loop()
    for _ in range(50):
        loop.call_exception_handler({
            "message": "socket.accept() out of system resource",
            "exception": OSError(errno.EMFILE, "Too many open files"),
        })
    words = ("out of system resource", "cannot accept")
    lines = [r for r in caplog.records if any(w in r.getMessage() for w in words)]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage(), [r.getMessage() for r in lines]
    assert not lines[0].exc_info
    # Control: any other loop error still reaches the default handler.
    loop.call_exception_handler({"message": "another loop error"})
    assert any(r.getMessage() == "another loop error" for r in caplog.records)
