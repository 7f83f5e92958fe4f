"""Keep-alive HTTP load on loopback, bounded in time, for the Ray suite and bench.ray_drain.

Each request is recorded with when it left and came back (monotonic), so that a test can tell
which requests were in flight at a given moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sent:
    """One request: when it left and came back (monotonic), and how it ended."""

    client: int
    started: float
    ended: float
    status: int  # 0: no answer
    error: str  # "" | "refused" | "closed" | "timeout" | "garbled"
    body: str = ""


class KeptConnection:
    """One HTTP/1.1 keep-alive connection (Content-Length or chunked answers)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.used = False

    @classmethod
    async def open(cls, port: int, timeout: float) -> KeptConnection:
        return cls(*await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout))

    async def get(self, path: str, timeout: float) -> tuple[int, str, bool]:
        """(status, body, must close); raises ConnectionError when closed before an answer."""
        self.used = True
        self.writer.write(f"GET {path} HTTP/1.1\r\nhost: ray\r\n\r\n".encode())
        await self.writer.drain()
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        length, chunked, close = 0, False, False
        for line in head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            key, value = key.strip().lower(), value.strip().lower()
            if key == b"content-length":
                length = int(value)
            chunked = chunked or (key == b"transfer-encoding" and value == b"chunked")
            close = close or (key == b"connection" and value == b"close")
        body = await asyncio.wait_for(self._chunks() if chunked else self.reader.readexactly(length), timeout)
        return status, body.decode(errors="replace"), close

    async def _chunks(self) -> bytes:
        parts = []
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)
        await self.reader.readuntil(b"\r\n")  # no trailers: the empty line
        return b"".join(parts)

    def close(self) -> None:
        self.writer.close()


@dataclass
class KeepAliveLoad:
    """`clients` connections to 127.0.0.1:port, each sending a request every `interval_s`.

    Like an HTTP client library: a request whose reused connection was closed before any answer
    is sent again once on a new connection (`resent` counts them); anything else that is not a
    200 counts as failed. Bounded by `stop` and `limit_s`.
    """

    port: int
    path: str
    clients: int = 3
    interval_s: float = 0.05
    timeout_s: float = 10.0
    limit_s: float = 600.0
    first_client: int = 0  # the number of the first client in `sent`
    sent: list[Sent] = field(default_factory=list)
    resent: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        deadline = time.monotonic() + self.limit_s
        await asyncio.gather(*(self._client(self.first_client + k, stop, deadline) for k in range(self.clients)))

    async def _client(self, k: int, stop: asyncio.Event, deadline: float) -> None:
        conn: KeptConnection | None = None
        await asyncio.sleep((k - self.first_client) * self.interval_s / self.clients)
        while not stop.is_set() and time.monotonic() < deadline:
            started = time.monotonic()
            conn, sent = await self._one(k, conn, started)
            self.sent.append(sent)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, started + self.interval_s - time.monotonic()))
        if conn is not None:
            conn.close()

    async def _one(self, k: int, conn: KeptConnection | None, started: float) -> tuple[KeptConnection | None, Sent]:
        for attempt in range(2):
            if conn is None:
                try:
                    conn = await KeptConnection.open(self.port, self.timeout_s)
                except (OSError, TimeoutError) as exc:
                    error = "timeout" if isinstance(exc, TimeoutError) else "refused"
                    return None, Sent(k, started, time.monotonic(), 0, error)
            reused = conn.used
            try:
                status, body, close = await conn.get(self.path, self.timeout_s)
            except ValueError:  # not HTTP/1.1 as it should be
                conn.close()
                return None, Sent(k, started, time.monotonic(), 0, "garbled")
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                conn.close()
                conn = None
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    self.resent += 1
                    continue
                error = "timeout" if isinstance(exc, TimeoutError) else "closed"
                return None, Sent(k, started, time.monotonic(), 0, error)
            if close:
                conn.close()
                conn = None
            return conn, Sent(k, started, time.monotonic(), status, "", body[:80])
        raise AssertionError("unreachable")


def failures(sent: list[Sent]) -> list[Sent]:
    return [s for s in sent if s.status != 200]


def as_json(sent: list[Sent]) -> list[dict[str, Any]]:
    return [asdict(s) for s in sent]


