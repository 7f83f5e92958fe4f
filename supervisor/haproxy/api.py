"""Async client for HAProxy's master CLI: a connection per line (its `;`-separated commands each
with an `@!<pid>` prefix), half-closed, the answer read until HAProxy closes."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

from .answers import ProcList, ReloadAnswer, parse_reload, parse_show_proc

# HAProxy accepts 10 master-CLI connections at once; leave room for an operator's socat.
MAX_CONNECTIONS = 8
# A command line must fit in tune.bufsize (16384 by default), with room for the newline.
DEFAULT_LINE_LIMIT = 16000


# Connections refused, or dropped unread, while the master re-executes: tried this often, this far apart.
RETRIES = 50
RETRY_S = 0.02


class _DroppedUnread(Exception):
    """The master closed the connection without reading the line (it re-executed)."""


class CLIError(Exception):
    """The master CLI could not be reached or did not answer in time."""


def on_process(pid: int, command: str) -> str:
    """Route a command to one process through the master: `@!<pid> <command>`."""
    return f"@!{int(pid)} {command}"


def batch_lines(commands: Iterable[str], limit: int = DEFAULT_LINE_LIMIT) -> list[str]:
    """Join commands with `;` into as few lines as fit in `limit` bytes each."""
    lines: list[str] = []
    current: list[str] = []
    size = 0
    for command in commands:
        if "\n" in command or ";" in command:
            raise ValueError(f"command would split into several: {command!r}")
        cost = len(command.encode()) + (1 if current else 0)
        if current and size + cost > limit:
            lines.append(";".join(current))
            current, size = [], 0
            cost = len(command.encode())
        if cost > limit:
            raise ValueError(f"command longer than the CLI line limit ({limit} bytes): {command[:60]}...")
        current.append(command)
        size += cost
    if current:
        lines.append(";".join(current))
    return lines


class MasterCLI:
    """The master socket. Every call opens its own connection, bounded by a semaphore."""

    def __init__(self, path: Path | str, timeout: float = 5.0):
        self.path = str(path)
        self.timeout = timeout
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def execute(self, line: str, timeout: float | None = None) -> str:
        async with self._slots:
            try:
                # asyncio.timeout, not wait_for: no extra task per line (a drain sends hundreds).
                async with asyncio.timeout(timeout or self.timeout):
                    return await self._roundtrip(line)
            except (TimeoutError, OSError, EOFError) as exc:
                kind = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc) or type(exc).__name__
                raise CLIError(f"master CLI {self.path}: {line.split(' ', 2)[:2]}: {kind}") from None

    async def _connect(self) -> socket.socket:
        # The socket refuses connections for a few milliseconds while the master re-executes.
        loop = asyncio.get_running_loop()
        for attempt in range(RETRIES):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, self.path)
                return sock
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                if attempt == RETRIES - 1:
                    raise
                await asyncio.sleep(RETRY_S)
            except BaseException:
                sock.close()
                raise
        raise AssertionError("unreachable")

    async def _roundtrip(self, line: str) -> str:
        # A connection the master re-executed before reading is dropped (EPIPE, or ECONNRESET
        # with no answer: the line never ran) and sent again; a reset mid-answer is an error.
        data = line.encode() + b"\n"
        for attempt in range(RETRIES):
            try:
                return await self._exchange(data)
            except _DroppedUnread:
                if attempt == RETRIES - 1:
                    raise ConnectionResetError("the master dropped every connection unread") from None
                await asyncio.sleep(RETRY_S)
        raise AssertionError("unreachable")

    async def _exchange(self, data: bytes) -> str:
        # Plain non-blocking socket calls: asyncio streams cost more CPU per line than the line.
        loop = asyncio.get_running_loop()
        sock = await self._connect()
        chunks: list[bytes] = []
        try:
            await loop.sock_sendall(sock, data)
            # The master CLI only answers once it sees the end of input.
            sock.shutdown(socket.SHUT_WR)
            while chunk := await loop.sock_recv(sock, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
        except (BrokenPipeError, ConnectionResetError):
            if chunks:
                raise
            raise _DroppedUnread from None
        finally:
            sock.close()

    async def execute_many(self, commands: Sequence[str], limit: int = DEFAULT_LINE_LIMIT) -> list[str]:
        """Send commands batched into lines, lines in parallel; answers per line, in order."""
        lines = batch_lines(commands, limit)
        return list(await asyncio.gather(*(self.execute(line) for line in lines)))

    async def show_proc(self) -> ProcList:
        return parse_show_proc(await self.execute("show proc"))

    async def reload(self) -> ReloadAnswer:
        return parse_reload(await self.execute("reload", timeout=max(self.timeout, 30.0)))

    async def on(self, pid: int, command: str, timeout: float | None = None) -> str:
        return await self.execute(on_process(pid, command), timeout)
