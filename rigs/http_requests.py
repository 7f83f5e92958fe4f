"""HTTP through HAProxy for end-to-end tests: one request on a new connection, and a loop of
them bounded in count and in time."""

from __future__ import annotations

import asyncio
import contextlib
import time

# ---------------------------------------------------------------- HTTP through HAProxy


async def http_get(port: int, path: str = "/", timeout: float = 5.0) -> tuple[int, dict[str, str], str]:
    """One request on a new connection: (status, headers, body); status 0 when it failed."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        writer.write(f"GET {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return 0, {}, ""
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        return 0, {}, ""
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return status, headers, body.decode(errors="replace").strip()


class RequestLoop:
    """Sequential requests on fresh connections until stopped; bounded in count and in time."""

    def __init__(
        self, port: int, max_requests: int = 5000, max_seconds: float = 30, pause: float = 0.005, path: str = "/"
    ) -> None:
        self.port = port
        self.path = path
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        self.pause = pause
        self.results: list[tuple[int, str]] = []  # (status, x-tag)
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> RequestLoop:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        while not self._stop.is_set() and len(self.results) < self.max_requests and time.monotonic() < deadline:
            status, headers, _ = await http_get(self.port, self.path, timeout=3)
            self.results.append((status, headers.get("x-tag", "")))
            await asyncio.sleep(self.pause)

    async def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.results

    @property
    def failures(self) -> list[tuple[int, str]]:
        return [r for r in self.results if r[0] != 200]
