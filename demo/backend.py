"""A tiny HTTP/1.1 backend for the demo and the tests: keep-alive, names itself.

    python demo/backend.py PORT NAME

GET /anything answers `200` with body NAME. GET /slow?ms=N waits N ms first.
Uses only the standard library so it starts in a few milliseconds.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from urllib.parse import parse_qs, urlsplit


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: bytes) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line = head.split(b"\r\n", 1)[0].decode(errors="replace")
            parts = request_line.split()
            target = parts[1] if len(parts) > 1 else "/"
            length = 0
            for header in head.split(b"\r\n")[1:]:
                key, _, value = header.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value.strip() or 0)
            if length:
                await reader.readexactly(length)
            url = urlsplit(target)
            if url.path == "/slow":
                ms = int(parse_qs(url.query).get("ms", ["1000"])[0])
                await asyncio.sleep(ms / 1000)
            body = name + b"\n"
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                + b"x-backend: " + name + b"\r\n"
                + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def serve(port: int, name: str) -> None:
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, name.encode()), "127.0.0.1", port, reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"backend {name} listening on 127.0.0.1:{port}", flush=True)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2]))
