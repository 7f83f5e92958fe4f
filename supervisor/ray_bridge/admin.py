"""Ray's `stats socket` (admin.sock), bound by the bridge and answered as HAProxy would.

Ray finds out which HAProxy runs by sending `show info` there and reading the `Pid:` line,
then saves `show servers state` and reads `show stat` (ray/serve/_private/haproxy.py,
HAProxyApi._send_socket_command: one command per connection, read until HAProxy closes).
Every command goes to the daemon's current worker, whose stats socket the daemon moved to
<runtime_dir>/stats.sock (haproxy.move_stats_socket); the answer comes back as the worker
gave it, except that `show info` carries the bridge's PID on its `Pid:` line: to Ray the
bridge is the HAProxy process it started.

The socket is bound under a temporary name and renamed over Ray's path, as HAProxy replaces
a unix socket: until the rename the path reaches the previous bridge, which keeps answering
with its own PID, and Ray keeps waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
from pathlib import Path

from ..files import bind_unix_private

log = logging.getLogger(__name__)

# HAProxy's default `stats timeout` (Ray's template says 30s too): an idle client is let go.
IDLE_TIMEOUT_S = 30.0
# The longest command line read (tune.bufsize caps HAProxy's own at 16 KiB by default).
MAX_COMMAND_BYTES = 1 << 20
_PID_LINE = re.compile(rb"^Pid: \d+(?=\r?$)", re.M)


def asks_show_info(line: bytes) -> bool:
    """Whether a command line (commands separated by `;`) holds a plain `show info`."""
    return any(command.split()[:2] == [b"show", b"info"] for command in line.split(b";"))


def with_pid(answer: bytes, pid: int) -> bytes:
    """`show info`'s answer with `pid` on its `Pid:` line."""
    return _PID_LINE.sub(b"Pid: %d" % pid, answer)


def socket_mode(words: tuple[str, ...] | list[str]) -> int:
    """The file mode a `stats socket` line asks for (`mode 666`); HAProxy's default is 0600
    under the usual umask."""
    for i, word in enumerate(words[:-1]):
        if word == "mode":
            with contextlib.suppress(ValueError):
                return int(words[i + 1], 8) & 0o777
    return 0o600


def bind_over(path: Path, mode: int) -> socket.socket:
    """A listening unix socket that has replaced whatever was at `path` in one rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    sock = bind_unix_private(tmp, mode)
    try:
        sock.listen(64)
        sock.setblocking(False)
        os.replace(tmp, path)
    except BaseException:
        sock.close()
        tmp.unlink(missing_ok=True)
        raise
    return sock


class AdminRelay:
    """Answers on Ray's admin socket: `show info` with `pid`, the rest relayed to `worker_socket`."""

    def __init__(self, worker_socket: Path, pid: int) -> None:
        self.worker_socket = worker_socket
        self.pid = pid
        self._server: asyncio.AbstractServer | None = None
        self._worker_down = False  # said once, until it answers again

    async def start(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_unix_server(self._client, sock=sock, limit=MAX_COMMAND_BYTES)

    def close(self) -> None:
        """Stop listening; the path is left alone (a newer bridge's socket may be there)."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Nothing read until the worker is reached: when nothing serves (HAProxy down), the
        # client's command is still unread in the socket, so closing resets the connection and
        # its read fails, as a connect to a dead HAProxy's socket would (Ray's health check:
        # not running), instead of reading an empty answer.
        writer.transport.pause_reading()
        worker = await self._open_worker()
        if worker is None:
            writer.transport.abort()
            return
        writer.transport.resume_reading()
        try:
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                line = await reader.readline()
            if line.strip():
                await self._relay(line if line.endswith(b"\n") else line + b"\n", worker, writer)
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            log.debug("admin socket client: %s", exc)
        finally:
            for stream in (worker[1], writer):
                stream.close()
                with contextlib.suppress(OSError):
                    await stream.wait_closed()

    async def _open_worker(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            async with asyncio.timeout(5):
                opened = await asyncio.open_unix_connection(str(self.worker_socket))
        except (OSError, TimeoutError) as exc:
            if not self._worker_down:
                log.warning("the daemon's worker does not answer on %s: %s", self.worker_socket, exc)
            self._worker_down = True
            return None
        if self._worker_down:
            log.info("the daemon's worker answers on %s again", self.worker_socket)
        self._worker_down = False
        return opened

    async def _relay(
        self, line: bytes, worker: tuple[asyncio.StreamReader, asyncio.StreamWriter], client: asyncio.StreamWriter
    ) -> None:
        reader, writer = worker
        writer.write(line)
        await writer.drain()
        if asks_show_info(line):
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                answer = await reader.read()
            client.write(with_pid(answer, self.pid))
            await client.drain()
            return
        while True:  # `show stat` of a big config: passed on as it comes
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                chunk = await reader.read(1 << 16)
            if not chunk:
                return
            client.write(chunk)
            await client.drain()
