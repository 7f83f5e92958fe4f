"""The runtime socket an ingress controller dials, relayed to HAProxy's `stats socket`. A line
in a safe order, and all after it, goes through untouched; any other is sent a command per
connection in a safe order, answers put back in the controller's order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ..haproxy.answers import parse_servers_state, validate_name
from .connections import (
    LONG_LINE,
    Address,
    IdleTimeout,
    QueueTimeout,
    UpstreamSlots,
    address_waits,
    connect_unix,
    has_payload,
    idle_timeout,
    parse_line,
    pipe_through,
    read_first_line,
    refuse_long_line,
    safe_order,
    service_changes,
    session_prefix,
    start_unix_server,
)

log = logging.getLogger(__name__)

# client-native waits 30 s for an answer; a command of ours must not outlast it.
COMMAND_TIMEOUT_S = 30.0
ADDRESS_WAIT_S = 1.0
ADDRESS_POLL_S = 0.002

ServiceCallback = Callable[[str, bool], None]  # ("backend/server", in service?)


class RuntimeRelay:
    def __init__(
        self, listen: Path, upstream: Path, on_service: ServiceCallback, capacity: Callable[[], int],
        queue_wait_s: float, idle_timeout_s: float, socket_mode: int, socket_owner: tuple[int, int] | None,
    ) -> None:
        self.listen = listen
        self.upstream = upstream
        self.on_service = on_service
        self.slots = UpstreamSlots(capacity, queue_wait_s)
        self.idle_timeout_s = idle_timeout_s
        self.socket_mode = socket_mode
        self.socket_owner = socket_owner
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await start_unix_server(self._serve, self.listen, self.socket_mode, self.socket_owner)
        log.info("controller runtime socket %s relays to %s", self.listen, self.upstream)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.listen)
        for task in list(self._connections):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve_one(reader, writer)
        except IdleTimeout:
            log.debug("controller runtime socket: idle for %gs: closed", self.idle_timeout_s)
        except (OSError, TimeoutError) as exc:
            log.warning("controller runtime socket: connection ended: %s", exc or type(exc).__name__)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await read_first_line(reader, self.idle_timeout_s)
        if line is None:
            await refuse_long_line(reader, writer, error_answer(LONG_LINE))
            return
        commands = parse_line(line.rstrip(b"\n"))
        for key, in_service in service_changes(commands).items():
            self.on_service(key, in_service)
        order = safe_order(commands)
        waits = address_waits(commands, order)
        prefix = session_prefix(commands)
        untouched = (order == sorted(order) and not waits) or not line.endswith(b"\n")
        payload = b""
        if not untouched and has_payload(line.rstrip(b"\n")):
            async with idle_timeout(self.idle_timeout_s):
                payload = await read_payload(reader)
        try:
            # One connection at a time for the whole line: once begun, its commands follow
            # each other instead of each waiting behind every caller that came meanwhile.
            async with self.slots.held():
                if untouched:
                    await pipe_through(
                        "controller runtime socket", self.upstream,
                        lambda: connect_unix(self.upstream, COMMAND_TIMEOUT_S),
                        lambda exc: unreachable_answer(prefix, self.upstream, exc), line, reader, writer,
                        self.idle_timeout_s,
                    )
                    return
                answer = await self._send_in_order([c.text for c in commands], order, prefix, payload, waits)
        except QueueTimeout as exc:
            answer = b"\n" * prefix + error_answer(str(exc))
        if not untouched:
            log.info("controller runtime socket: %d commands sent in a safe order", len(commands))
        writer.write(answer)
        await writer.drain()

    async def _send_in_order(
        self, texts: list[bytes], order: list[int], prefix: int, payload: bytes, waits: dict[int, Address]
    ) -> bytes:
        head = b";".join(texts[:prefix])
        try:
            head_answer = await self._roundtrip(head + b"\n") if prefix else b""
        except OSError as exc:
            return unreachable_answer(prefix, self.upstream, exc)
        answers: dict[int, bytes] = {}
        last = len(texts) - 1
        for index in order:
            if index < prefix:
                continue
            data = (head + b";" if prefix else b"") + texts[index] + b"\n"
            if index == last:
                data += payload
            try:
                answer = await self._roundtrip(data)
            except OSError as exc:
                answer = error_answer(f"{self.upstream}: {exc.strerror or exc}")
            else:
                if answer.startswith(head_answer):
                    answer = answer[len(head_answer) :]
            answers[index] = answer
            if index in waits:
                await self._wait_address(waits[index])
        return head_answer + b"".join(answers[i] for i in range(prefix, len(texts)))

    async def _wait_address(self, target: Address) -> None:
        """HAProxy 3.0 applies an address later: until the server shows it."""
        backend, _, server = target.server.partition("/")
        try:
            line = f"show servers state {validate_name('backend', backend)}\n".encode()
            validate_name("server", server)
        except ValueError:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ADDRESS_WAIT_S
        while True:
            try:
                answer = await self._roundtrip(line)
            except OSError:
                return
            states = {s.name: s for s in parse_servers_state(answer.decode(errors="replace"))}
            state = states.get(server)
            if state is None or (state.address == target.address and target.port in (None, state.port)):
                return
            if loop.time() >= deadline:
                log.warning("controller runtime socket: %s does not show %s after %.1fs: put in service anyway",
                            target.server, target.address, ADDRESS_WAIT_S)
                return
            await asyncio.sleep(ADDRESS_POLL_S)

    async def _roundtrip(self, data: bytes) -> bytes:
        """The caller holds a slot."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            reader, writer = await connect_unix(self.upstream, COMMAND_TIMEOUT_S)
            try:
                writer.write(data)
                await writer.drain()
                return await reader.read()  # HAProxy closes after a line it does not prompt for
            finally:
                writer.close()


async def read_payload(reader: asyncio.StreamReader) -> bytes:
    """The payload after a `<<` line, up to and including the empty line that ends it."""
    lines = []
    while part := await reader.readline():
        lines.append(part)
        if part in (b"\n", b"\r\n"):
            break
    return b"".join(lines)


def error_answer(message: str) -> bytes:
    """As HAProxy answers under `set severity-output number`: client-native's failure."""
    return f"[3]: haproxy-supervisor: {message}\n\n".encode()


def unreachable_answer(prefix: int, upstream: Path, exc: OSError) -> bytes:
    return b"\n" * prefix + error_answer(f"HAProxy's runtime socket {upstream}: {exc.strerror or exc}")


