"""What both controller sockets share (relay.py, facade.py): listening, reading, relaying and
connecting to HAProxy within its limits; and the runtime socket's lines read as commands."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..files import bind_unix_private
from ..haproxy.answers import ServerKey
from ..haproxy.config import Config


class Effect(Enum):
    ADDRESS = "address"  # `set server B/S addr ...`: where it points
    OUT_OF_SERVICE = "out of service"  # maint, `disable server`, health or agent down
    IN_SERVICE = "in service"  # ready, `enable server`, health or agent up
    OTHER = "other"  # weight, maxconn, ... : names the server, changes neither


@dataclass(frozen=True)
class Command:
    text: bytes  # as the controller wrote it, without the `;`
    server: str | None = None  # "backend/server" of a server command
    effect: Effect | None = None


def split_line(line: bytes) -> list[bytes]:
    """The commands of one line (without its newline), split on `;` not escaped by a backslash."""
    commands: list[bytes] = []
    start = 0
    escaped = False
    for i, byte in enumerate(line):
        if escaped:
            escaped = False
        elif byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x3B:  # ;
            commands.append(line[start:i])
            start = i + 1
    commands.append(line[start:])
    return commands


# `set server B/S <what> <value>`: the values that take a server out of service or put it back.
_SET_SERVER_EFFECTS = {
    (b"state", b"maint"): Effect.OUT_OF_SERVICE, (b"state", b"ready"): Effect.IN_SERVICE,
    (b"health", b"down"): Effect.OUT_OF_SERVICE, (b"health", b"up"): Effect.IN_SERVICE,
    (b"agent", b"down"): Effect.OUT_OF_SERVICE, (b"agent", b"up"): Effect.IN_SERVICE,
}


def parse_command(text: bytes) -> Command:
    words = text.split()
    if len(words) >= 3 and words[0] in (b"disable", b"enable") and words[1] == b"server":
        return Command(text, _key(words[2]), Effect.OUT_OF_SERVICE if words[0] == b"disable" else Effect.IN_SERVICE)
    if len(words) >= 4 and words[0] == b"set" and words[1] == b"server":
        what, value = words[3], words[4] if len(words) > 4 else b""
        effect = Effect.ADDRESS if what in (b"addr", b"fqdn") else _SET_SERVER_EFFECTS.get((what, value))
        return Command(text, _key(words[2]), effect or Effect.OTHER)
    return Command(text)


def _key(word: bytes) -> str | None:
    backend, sep, server = word.decode(errors="replace").partition("/")
    return ServerKey.of(backend, server) if sep and backend and server else None


def parse_line(line: bytes) -> list[Command]:
    return [parse_command(text) for text in split_line(line)]


def safe_order(commands: list[Command]) -> list[int]:
    """Indexes into `commands`: a server's out-of-service command moves before the address
    changes to it just before (else it serves the placeholder address: 503 `SC`)."""
    order = list(range(len(commands)))
    for j, command in enumerate(commands):
        if command.effect is not Effect.OUT_OF_SERVICE or command.server is None:
            continue
        earliest = None
        for position in range(order.index(j) - 1, -1, -1):
            earlier = commands[order[position]]
            if earlier.server != command.server:
                continue
            if earlier.effect is not Effect.ADDRESS:
                break
            earliest = position
        if earliest is not None:
            order.remove(j)
            order.insert(earliest, j)
    return order


@dataclass(frozen=True)
class Address:
    server: str
    address: str
    port: int | None  # None: the command keeps the port


def requested_address(command: Command) -> Address | None:
    """The IP (and port) of `set server B/S addr IP [port P]`; None for a name (fqdn) or no IP."""
    words = command.text.split()
    if command.server is None or command.effect is not Effect.ADDRESS or words[3:4] != [b"addr"] or len(words) < 5:
        return None
    address = words[4].decode(errors="replace")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return None
    port = None
    if len(words) >= 7 and words[5] == b"port":
        if not words[6].isdigit():
            return None
        port = int(words[6])
    return Address(command.server, address, port)


def address_waits(commands: list[Command], order: list[int]) -> dict[int, Address]:
    """The address commands next followed (among their server's) by one putting it in service:
    from 3.0 HAProxy applies an address later, `state ready` at once (else 503 `SC`)."""
    waits: dict[int, Address] = {}
    for position, index in enumerate(order):
        target = requested_address(commands[index])
        if target is None:
            continue
        for later in order[position + 1 :]:
            if commands[later].server != target.server:
                continue
            if commands[later].effect is Effect.IN_SERVICE:
                waits[index] = target
            break
    return waits


def service_changes(commands: list[Command]) -> dict[str, bool]:
    """Per server the line takes out of service (False) or puts back (True): its last word."""
    return {
        command.server: command.effect is Effect.IN_SERVICE for command in commands
        if command.server is not None and command.effect in (Effect.OUT_OF_SERVICE, Effect.IN_SERVICE)
    }


def session_prefix(commands: list[Command]) -> int:
    """How many leading commands set up the session (`set severity-output ...`): repeated before
    each command sent on a connection of its own."""
    count = 0
    while count < len(commands) and commands[count].text.split()[:2] == [b"set", b"severity-output"]:
        count += 1
    return count


def has_payload(line: bytes) -> bool:
    """Whether the payload that follows a line belongs to it (HAProxy's `<<` at its end)."""
    return line.rstrip(b"\r").endswith(b"<<")


log = logging.getLogger(__name__)

# A longer first line is refused (HAProxy's tune.bufsize is 16 KiB by default; the controller
# cuts its lines at 16,000 bytes).
LINE_LIMIT = 1 << 20
LONG_LINE = f"a line longer than {LINE_LIMIT} bytes is refused"
DISCARD_S = 1.0
# HAProxy's `stats maxconn` when neither it nor the socket's `maxconn` is set.
HAPROXY_STATS_MAXCONN = 10
LISTEN_BACKLOG = 4096
CHUNK = 1 << 16


def stats_socket_capacity(config: Config | None, path: Path) -> int:
    """The stats socket's own `maxconn`, else global `stats maxconn`, else HAProxy's default."""
    capacity = HAPROXY_STATS_MAXCONN
    socket_maxconn = None
    sections = config.sections if config is not None else []
    for words in (line.words for section in sections if section.kind == "global" for line in section.body):
        if words[:2] == ("stats", "maxconn") and len(words) > 2 and words[2].isdigit():
            capacity = int(words[2])
        elif words[:2] == ("stats", "socket") and len(words) > 2 and words[2] == str(path):
            for i, word in enumerate(words[3:-1], start=3):
                if word == "maxconn" and words[i + 1].isdigit():
                    socket_maxconn = int(words[i + 1])
    return max(1, socket_maxconn if socket_maxconn is not None else capacity)


class QueueTimeout(Exception):
    """A caller waited its whole bound for a connection to HAProxy's socket."""


class UpstreamSlots:
    """At most `capacity()` connections to HAProxy's socket; others wait in order, up to `wait_s`."""

    def __init__(self, capacity: Callable[[], int], wait_s: float) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.in_use = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if not self._waiting and self.in_use < self.capacity():
            self.in_use += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            async with asyncio.timeout(self.wait_s):
                await turn  # _release counted us in
        except BaseException as exc:
            if turn.done() and not turn.cancelled():
                self._release()  # the slot came as the wait ended: pass it on
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(f"waited {self.wait_s:g}s for one of HAProxy's {self.capacity()} "
                                   "runtime connections") from None
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(turn)

    def _release(self) -> None:
        self.in_use -= 1
        while self._waiting and self.in_use < self.capacity():
            turn = self._waiting.popleft()
            if not turn.done():
                self.in_use += 1
                turn.set_result(None)


async def connect_unix(path: Path, patience_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Retried while the listener's queue is full: asyncio's open_unix_connection takes that
    EAGAIN for a connect in progress and hands back a socket that never connected."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    delay = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(path))
        except BlockingIOError:
            sock.close()
            if loop.time() >= deadline:
                raise OSError(errno.EAGAIN, f"its queue stayed full for {patience_s:g}s") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
            continue
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_unix_connection(sock=sock, limit=CHUNK)


class IdleTimeout(Exception):
    """A connection sent and received nothing for the idle timeout."""


@contextlib.asynccontextmanager
async def idle_timeout(seconds: float) -> AsyncIterator[Callable[[], None]]:
    """IdleTimeout after `seconds`, counted again from each call of what it yields."""
    loop = asyncio.get_running_loop()
    timer = asyncio.timeout(seconds)
    try:
        async with timer:
            yield lambda: timer.reschedule(loop.time() + seconds)
    except TimeoutError:
        if timer.expired():
            raise IdleTimeout() from None
        raise


async def read_first_line(reader: asyncio.StreamReader, idle_s: float) -> bytes | None:
    """A connection's first line; None for one longer than LINE_LIMIT."""
    async with idle_timeout(idle_s):
        try:
            return await reader.readline()  # one without a newline before EOF: HAProxy judges it
        except ValueError:  # longer than LINE_LIMIT, the reader's limit
            return None


async def pipe_through(
    what: str,
    upstream: Path,
    connect: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]],
    unreachable: Callable[[OSError], bytes],
    first: bytes,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    idle_s: float,
    check: Callable[[bytes], bytes | None] | None = None,
) -> None:
    """Send `first` upstream, then copy both ways until HAProxy ends the session or it idles.
    `check`: each later client line; an answer it returns ends the session with it."""
    try:
        up_reader, up_writer = await connect()
    except OSError as exc:
        log.warning("%s: %s: %s", what, upstream, exc.strerror or exc)
        writer.write(unreachable(exc))
        await writer.drain()
        return
    refused: list[bytes] = []
    try:
        up_writer.write(first)
        await up_writer.drain()
        async with idle_timeout(idle_s) as active:

            async def to_upstream() -> None:
                if check is None:
                    while chunk := await reader.read(CHUNK):
                        active()
                        up_writer.write(chunk)
                        await up_writer.drain()
                else:
                    while True:
                        try:
                            line = await reader.readline()
                        except ValueError:  # longer than LINE_LIMIT
                            refused.append(error_line(LONG_LINE))
                            break
                        if not line:
                            break
                        active()
                        answer = check(line)
                        if answer is not None:
                            refused.append(answer)
                            break
                        up_writer.write(line)
                        await up_writer.drain()
                if refused:
                    up_writer.close()
                    return
                if up_writer.can_write_eof():
                    up_writer.write_eof()

            forward = asyncio.create_task(to_upstream())
            try:
                while chunk := await up_reader.read(CHUNK):
                    active()
                    writer.write(chunk)
                    await writer.drain()
            finally:
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await forward
    finally:
        up_writer.close()
    if refused:
        writer.write(refused[0])
        await writer.drain()


async def refuse_long_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes) -> None:
    """Answer, then drop what the caller still sends for a moment: closed with unread bytes,
    the socket would be reset and the caller lose the answer."""
    writer.write(answer)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(DISCARD_S):
            while await reader.read(CHUNK):
                pass


def error_line(message: str) -> bytes:
    return f"haproxy-supervisor: {message}\n".encode()


async def start_unix_server(
    serve: Callable, path: Path, mode: int, owner: tuple[int, int] | None
) -> asyncio.AbstractServer:
    """Listen at `path`, replacing a socket a previous daemon left there; the file has `mode`
    (never wider while made) and `owner` (uid, gid), the controller's in another container."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_socket():
            path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = bind_unix_private(path, mode & 0o700 if owner is not None else mode)
    try:
        if owner is not None:
            os.chown(path, *owner)
            os.chmod(path, mode)
        # Callers come all at once (a sync of every backend, scrapers, an operator's socat):
        # the kernel's queue of 100 would refuse some before the loop accepts them.
        return await asyncio.start_unix_server(serve, sock=sock, limit=LINE_LIMIT, backlog=LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
