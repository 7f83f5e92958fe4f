"""Fault: the master re-executes while the daemon's CLI client talks to it.

On reload the master closes its CLI socket and execs itself. A connection it had accepted but
not read from is dropped: the client's write fails with EPIPE, or its read with ECONNRESET (the
line was left unread, so it never ran). The client used to report these as CLIError, failing a
steering round, a push or a `show proc` of the reload's confirmation for a routine reload; it
only waited out the refused connects. Now such a line is sent again. Clients here send reads
in a loop, through the daemon's MasterCLI, while the master reloads; the control is the same
loop on a raw socket, which shows the drops happen.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time

import pytest

from rigs.harness import HAProxyMaster, free_port
from supervisor.haproxy.answers import parse_show_proc
from supervisor.haproxy.api import CLIError, MasterCLI

pytestmark = pytest.mark.haproxy

CONFIG = """\
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s

frontend fe
    bind 127.0.0.1:{port}
"""
RELOADS = 15
CLIENTS = 4
# Bounds the loops: each reload lets the clients run this long.
BETWEEN_RELOADS_S = 0.3


def raw_show_proc(path: str) -> str:
    """One `show proc` on a blocking socket, without retries: how it ended."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        try:
            s.connect(path)
            s.sendall(b"show proc\n")
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except OSError as exc:
            return type(exc).__name__
    return "answered" if chunks else "empty"


def kind_of(error: CLIError) -> str:
    """`dropped`: the master dropped the line unread, what the client must send again. Refused
    connects past the client's retries, or timeouts, on a machine too busy, are no drop."""
    text = str(error)
    dropped = any(word in text for word in ("reset", "Broken pipe", "unread"))
    return "dropped" if dropped else f"CLIError: {text}"


async def reloading(master: HAProxyMaster, cli: MasterCLI, client) -> collections.Counter:
    """Reload RELOADS times while CLIENTS run `client` in a loop; how their calls ended."""
    seen: collections.Counter = collections.Counter()
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            seen[await client()] += 1
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(loop()) for _ in range(CLIENTS)]
    try:
        for _ in range(RELOADS):
            before = time.monotonic()
            try:
                await cli.reload()
            except CLIError as exc:  # sent while the master re-executed from the reload before
                seen[f"reload: {kind_of(exc)}"] += 1
            await asyncio.sleep(max(0.0, before + BETWEEN_RELOADS_S - time.monotonic()))
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return seen


async def test_the_cli_client_sends_again_a_line_the_reexecuting_master_dropped(rundir):
    cfg = rundir / "haproxy.cfg"
    cfg.write_text(CONFIG.format(port=free_port()))
    master = HAProxyMaster(cfg, rundir).start()
    try:
        cli = MasterCLI(master.socket, timeout=5)

        async def control() -> str:
            return await asyncio.to_thread(raw_show_proc, str(master.socket))

        async def daemons_client() -> str:
            try:
                answer = await cli.execute("show proc")
            except CLIError as exc:
                return kind_of(exc)
            procs = parse_show_proc(answer)
            # An empty answer: the master read the line and re-executed before answering.
            return "answered" if procs.master is not None else "empty" if not answer.strip() else answer

        raw = await reloading(master, cli, control)
        ours = await reloading(master, cli, daemons_client)
    finally:
        master.stop()
    print(f"raw socket: {dict(raw)}; MasterCLI: {dict(ours)}")
    dropped = raw["BrokenPipeError"] + raw["ConnectionResetError"]
    assert dropped > 0, f"the control saw no connection dropped by a re-exec: {dict(raw)}"
    assert ours["dropped"] == 0 and ours["reload: dropped"] == 0, dict(ours)
    assert ours["answered"] > RELOADS, dict(ours)
