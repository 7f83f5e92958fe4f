"""The runtime socket an ingress controller dials, relayed to HAProxy's own `stats socket`.

A connection's first line is read and parsed (commands.py). A line whose commands are
already in a safe order, and everything after it, goes to HAProxy untouched, byte for
byte both ways (an interactive `prompt` session included). A line with a server whose
address changes before it goes out of service, or before it is put in service, is sent one
command per connection: out of service first, and an address change seen applied (`show
servers state`) before the server is put in service. The answers are put back in the
controller's order: its first answer is still its `set severity-output` one, and the error
check it runs on the next reads the answer of the command it sent next.

Servers a line takes out of service are made known-dead to the old workers before the line
is sent (`on_service`); servers it puts back are unmarked.

However many callers connect, at most as many connections reach HAProxy's socket as it
accepts (`UpstreamSlots`, sized by `stats_socket_capacity`): a line, reordered or relayed as
it is, holds one for as long as it takes (its commands go one connection after the other).
Callers wait in arrival order, up to a bounded time; a line that waited that long is
answered `[3]:` and never sent. A connection idle for `idle_timeout_s` (HAProxy's `stats
timeout`) is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from ..files import bind_unix_private
from ..haproxy.answers import parse_servers_state
from ..haproxy.config import Config
from ..haproxy.names import validate_name
from .commands import Address, address_waits, has_payload, parse_line, safe_order, service_changes, session_prefix

log = logging.getLogger(__name__)

# client-native waits 30 s for an answer; a command of ours must not outlast it.
COMMAND_TIMEOUT_S = 30.0
# A first line longer than this is refused with one line (HAProxy's own limit, tune.bufsize,
# is 16 KiB by default; the controller cuts its lines at 16,000 bytes).
LINE_LIMIT = 1 << 20
# How long the rest of a refused line is read and dropped before the connection closes.
DISCARD_S = 1.0
# HAProxy's `stats maxconn` when neither it nor the socket's `maxconn` is set.
HAPROXY_STATS_MAXCONN = 10
# How many connections may wait for the daemon's listening sockets to accept them.
LISTEN_BACKLOG = 4096
CHUNK = 1 << 16
# How long a server may take to show an address change before it is put in service anyway.
ADDRESS_WAIT_S = 1.0
ADDRESS_POLL_S = 0.002

ServiceCallback = Callable[[str, bool], None]  # ("backend/server", in service?)


def stats_socket_capacity(config: Config | None, path: Path) -> int:
    """How many connections HAProxy accepts at once on its stats socket at `path`: the
    socket's own `maxconn`, else global `stats maxconn`, else HAProxy's default."""
    if config is None:
        return HAPROXY_STATS_MAXCONN
    capacity = HAPROXY_STATS_MAXCONN
    socket_maxconn = None
    for section in config.sections:
        if section.kind != "global":
            continue
        for line in section.body:
            words = line.words
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
    """At most `capacity()` connections to HAProxy's socket at once; the callers beyond it
    wait in arrival order, each at most `wait_s` (QueueTimeout)."""

    def __init__(self, capacity: Callable[[], int], wait_s: float) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.in_use = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

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
        except TimeoutError:
            if turn.done() and not turn.cancelled():
                self._release()  # the slot came as the wait ran out: pass it on
            raise QueueTimeout(f"waited {self.wait_s:g}s for one of HAProxy's {self.capacity()} "
                               "runtime connections") from None
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._release()
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


class RuntimeRelay:
    """A unix socket at `listen` in front of HAProxy's runtime socket at `upstream`."""

    def __init__(
        self, listen: Path, upstream: Path, on_service: ServiceCallback | None = None,
        capacity: Callable[[], int] = lambda: HAPROXY_STATS_MAXCONN, queue_wait_s: float = 20.0,
        idle_timeout_s: float = 10.0, socket_mode: int = 0o660, socket_owner: tuple[int, int] | None = None,
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

    # ------------------------------------------------------------ one connection

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve_one(reader, writer)
        except IdleTimeout:
            log.debug("controller runtime socket: idle for %gs: closed", self.idle_timeout_s)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            log.warning("controller runtime socket: connection ended: %s", exc or type(exc).__name__)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await read_first_line(reader, self.idle_timeout_s)
        if line is None:
            await refuse_long_line(reader, writer, error_answer(f"a line longer than {LINE_LIMIT} bytes is refused"))
            return
        commands = parse_line(line.rstrip(b"\n"))
        changes = service_changes(commands)
        if self.on_service is not None:
            for key, in_service in changes.items():
                self.on_service(key, in_service)
        order = safe_order(commands)
        waits = address_waits(commands, order)
        if (order == sorted(order) and not waits) or not line.endswith(b"\n"):
            await self._pipe(line, reader, writer)
            return
        payload = b""
        if has_payload(line.rstrip(b"\n")):
            async with idle_timeout(self.idle_timeout_s):
                payload = await read_payload(reader)
        texts = [c.text for c in commands]
        prefix = session_prefix(commands)
        try:
            # One connection at a time for the whole line: once begun, its commands follow
            # each other instead of each waiting behind every caller that came meanwhile.
            async with self.slots.held():
                answer = await self._send_in_order(texts, order, prefix, payload, waits)
        except QueueTimeout as exc:
            answer = b"\n" * prefix + error_answer(str(exc))
        log.info("controller runtime socket: %d commands sent in a safe order", len(texts))
        writer.write(answer)
        await writer.drain()

    async def _send_in_order(
        self, texts: list[bytes], order: list[int], prefix: int, payload: bytes, waits: dict[int, Address]
    ) -> bytes:
        """Each command on its own connection after the session's commands; the answers in
        the order of `texts`."""
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
        """Until the server shows the address it was given (HAProxy 3.0 applies it later)."""
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
        """One line to HAProxy on a connection of its own; the caller holds a slot."""
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            reader, writer = await connect_unix(self.upstream)
            try:
                writer.write(data)
                await writer.drain()
                return await reader.read()  # HAProxy closes after a line it does not prompt for
            finally:
                writer.close()

    async def _pipe(self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        prefix = session_prefix(parse_line(first.rstrip(b"\n")))
        try:
            async with self.slots.held():
                await pipe_through(
                    "controller runtime socket", self.upstream, lambda: connect_unix(self.upstream),
                    lambda exc: unreachable_answer(prefix, self.upstream, exc), first, reader, writer,
                    self.idle_timeout_s,
                )
        except QueueTimeout as exc:
            writer.write(b"\n" * prefix + error_answer(str(exc)))
            await writer.drain()


async def connect_unix(path: Path, patience_s: float = COMMAND_TIMEOUT_S, limit: int = CHUNK,
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the unix socket at `path`, retried while its listener's queue is full.

    A non-blocking connect() to a unix socket whose backlog is full fails with EAGAIN, which
    asyncio's open_unix_connection takes for a connect in progress: it hands back a socket
    that never connected, whose reads fail with EINVAL and whose writes end in "Connection
    lost". Here EAGAIN is what it is: HAProxy has not accepted yet, so wait and try again.
    """
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
        return await asyncio.open_unix_connection(sock=sock, limit=limit)


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
    """A connection's first line with its newline (without one at EOF); None for one longer
    than LINE_LIMIT. IdleTimeout when it does not come in time."""
    async with idle_timeout(idle_s):
        try:
            return await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as partial:
            return partial.partial  # no newline before EOF: HAProxy judges it
        except asyncio.LimitOverrunError:
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
    """Send `first` upstream, then relay both ways until nothing moves for `idle_s`; an
    upstream that cannot be reached is answered `unreachable(exc)`. `check`: each later line
    from the client before it goes upstream; what it returns ends the session with that answer."""
    try:
        up_reader, up_writer = await connect()
    except OSError as exc:
        log.warning("%s: %s: %s", what, upstream, exc.strerror or exc)
        writer.write(unreachable(exc))
        await writer.drain()
        return
    try:
        up_writer.write(first)
        await up_writer.drain()
        await relay_both_ways(reader, writer, up_reader, up_writer, idle_s, check)
    finally:
        up_writer.close()


async def relay_both_ways(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
    idle_s: float,
    check: Callable[[bytes], bytes | None] | None = None,
) -> None:
    """Copy both ways until the upstream side closes (HAProxy ends the session), or nothing
    moved either way for `idle_s` (IdleTimeout)."""
    refused: list[bytes] = []

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
                        line = await reader.readuntil(b"\n")
                    except asyncio.IncompleteReadError as partial:
                        line = partial.partial
                    except asyncio.LimitOverrunError:
                        refused.append(error_line(f"a line longer than {LINE_LIMIT} bytes is refused"))
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
    if refused:
        writer.write(refused[0])
        await writer.drain()


async def read_payload(reader: asyncio.StreamReader) -> bytes:
    """The payload after a `<<` line: its lines up to and including the empty one that ends it."""
    lines = []
    while True:
        try:
            part = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as partial:
            lines.append(partial.partial)
            break
        lines.append(part)
        if part in (b"\n", b"\r\n"):
            break
    return b"".join(lines)


async def refuse_long_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes) -> None:
    """Answer a line too long to read, then take what the caller still sends, for a moment:
    closed with unread bytes, the socket would be reset and the caller lose the answer."""
    writer.write(answer)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(DISCARD_S):
            while await reader.read(CHUNK):
                pass


def error_answer(message: str) -> bytes:
    """An error in the shape HAProxy answers with under `set severity-output number` ([3]: err),
    which client-native's callers take as a failed command."""
    return f"[3]: haproxy-supervisor: {message}\n\n".encode()


def unreachable_answer(prefix: int, upstream: Path, exc: OSError) -> bytes:
    return b"\n" * prefix + error_answer(f"HAProxy's runtime socket {upstream}: {exc.strerror or exc}")


def error_line(message: str) -> bytes:
    """An error in the master socket's shape: one line."""
    return f"haproxy-supervisor: {message}\n".encode()


async def start_unix_server(
    serve: Callable, path: Path, mode: int = 0o660, owner: tuple[int, int] | None = None,
) -> asyncio.AbstractServer:
    """Listen at `path`, replacing a socket a previous daemon left there. The socket's file
    has `mode` (never wider while it is being made) and, when given, `owner` (uid, gid): the
    controller's user, who runs in another container of the pod."""
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
