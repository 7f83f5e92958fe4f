"""The master socket an ingress controller reloads through. haproxytech's controller sends
`reload;quit` and reads `Success=1` or `Success=0`, `--`, then startup messages it scans for
`[ALERT]`. Every line without a `reload` goes to HAProxy's master socket untouched."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from enum import Enum
from pathlib import Path

from ..state import ReloadRecord
from .connections import (
    LONG_LINE,
    IdleTimeout,
    connect_unix,
    error_line,
    pipe_through,
    read_first_line,
    refuse_long_line,
    split_line,
    start_unix_server,
)

log = logging.getLogger(__name__)

# The master re-executes itself on reload and refuses connections meanwhile; a master
# being started the first time takes longer.
CONNECT_PATIENCE_S = 5.0
ANSWER_TIMEOUT_S = 60.0

# The successful results of the daemon's cycle, as the answer to `reload` names them.
DONE = {"ok": "reloaded", "runtime_applied": "applied at runtime", "skipped_unchanged": "unchanged"}

ReloadNow = Callable[[], Awaitable[ReloadRecord | None]]


def reload_answer(record: ReloadRecord | None, pid: int) -> bytes:
    """In the shape HAProxy 2.7+ answers `reload` on its master socket."""
    if record is None:
        return f"Success=0\n--\n[ALERT]    ({pid}) : haproxy-supervisor: stopping, no reload\n\n".encode()
    if record.result in DONE:
        return f"Success=1\n--\n[NOTICE]   ({pid}) : haproxy-supervisor: {DONE[record.result]}\n\n".encode()
    if record.result == "invalid" and record.error:
        # `haproxy -c`'s own messages: its [ALERT] lines are what the controller looks for.
        messages = record.error if "[ALERT]" in record.error else f"[ALERT]    ({pid}) : {record.error}"
        return f"Success=0\n--\n{messages.rstrip()}\n\n".encode()
    reason = record.error or record.result
    return f"Success=0\n--\n[ALERT]    ({pid}) : haproxy-supervisor: reload {record.result}: {reason}\n\n".encode()


# Words HAProxy's master runs as work of its own: `reload` and `hard-reload` start a new
# master and workers, `_send_status` is a new worker's report of its start (a forged one
# ends a reload the master did not do), `mcli-debug-mode` opens every worker command on the
# master itself.
OUTSIDE_THE_DAEMON = ("reload", "_send_status", "mcli-debug-mode")


class MasterCommand(Enum):
    RELOAD = "the daemon's reload"
    REFUSED = "refused"
    PASS = "passed to HAProxy's master"


def classify_master_command(command: bytes) -> MasterCommand:
    """`reload` (alone, or after `@master`) is the daemon's; any other command with a word of
    OUTSIDE_THE_DAEMON (in any case, escaped or quoted) is refused; the rest pass."""
    words = command.split()
    plain = [w.replace(b"\\", b"").replace(b"'", b"").replace(b'"', b"").lower() for w in words]
    if not any(word in w for w in plain for word in (k.encode() for k in OUTSIDE_THE_DAEMON)):
        return MasterCommand.PASS
    if words in ([b"reload"], [b"@master", b"reload"]):
        return MasterCommand.RELOAD
    return MasterCommand.REFUSED


def refusal(command: bytes) -> bytes:
    shown = command.decode(errors="replace").strip()[:80]
    return error_line(f"{shown!r} refused: the daemon owns HAProxy's reloads; send `reload`")


def master_line_check(line: bytes) -> bytes | None:
    """None when HAProxy's master may have every command of the line as it is; else the refusal
    of the first that may not, which ends a relayed session (a later `reload` included)."""
    for command in split_line(line.rstrip(b"\r\n")):
        if classify_master_command(command) is not MasterCommand.PASS:
            return refusal(command)
    return None


class MasterFacade:
    def __init__(
        self, listen: Path, upstream: Path, reload_now: ReloadNow, idle_timeout_s: float, socket_mode: int,
        socket_owner: tuple[int, int] | None,
    ) -> None:
        self.listen = listen
        self.upstream = upstream
        self.reload_now = reload_now
        self.idle_timeout_s = idle_timeout_s
        self.socket_mode = socket_mode
        self.socket_owner = socket_owner
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await start_unix_server(self._serve, self.listen, self.socket_mode, self.socket_owner)
        log.info("controller master socket %s: reload runs the daemon's cycle", self.listen)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.listen)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await read_first_line(reader, self.idle_timeout_s)
            if line is None:
                await refuse_long_line(reader, writer, error_line(LONG_LINE))
                return
            if master_line_check(line) is None:
                await pipe_through(
                    "controller master socket", self.upstream, self._connect,
                    lambda exc: error_line(f"{self.upstream}: {exc.strerror or exc}"), line, reader, writer,
                    self.idle_timeout_s, master_line_check,
                )
                return
            writer.write(await self._answer(split_line(line.rstrip(b"\r\n"))))
            await writer.drain()
        except IdleTimeout:
            log.debug("controller master socket: idle for %gs: closed", self.idle_timeout_s)
        except (OSError, TimeoutError) as exc:
            log.warning("controller master socket: connection ended: %s", exc or type(exc).__name__)
        finally:
            writer.close()

    async def _answer(self, commands: list[bytes]) -> bytes:
        answers: list[bytes] = []
        for command in commands:
            if command.split() == [b"quit"]:
                break
            kind = classify_master_command(command)
            if kind is MasterCommand.REFUSED:
                log.warning("controller master socket: refused %r", command.decode(errors="replace")[:80])
                answers.append(refusal(command))
                break
            if kind is MasterCommand.RELOAD:
                log.info("controller master socket: reload requested")
                answers.append(reload_answer(await self.reload_now(), os.getpid()))
                continue
            try:
                async with asyncio.timeout(ANSWER_TIMEOUT_S):
                    up_reader, up_writer = await self._connect()
                    try:
                        up_writer.write(command + b"\n")
                        await up_writer.drain()
                        up_writer.write_eof()  # the master answers a line once its input ends
                        answers.append(await up_reader.read())
                    finally:
                        up_writer.close()
            except (OSError, TimeoutError) as exc:
                answers.append(error_line(f"{self.upstream}: {exc or 'timed out'}"))
        return b"".join(answers)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_PATIENCE_S
        while True:
            try:
                return await connect_unix(self.upstream, CONNECT_PATIENCE_S)
            except (ConnectionRefusedError, FileNotFoundError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.05)
