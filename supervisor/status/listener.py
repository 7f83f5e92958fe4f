"""The hardened listener the app is served on: TCP or a unix socket (0660), a connection limit
within the descriptor budget, a header timeout; and `StatusServer`, the daemon component."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import stat
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ..eventloop import on_grid, wait_set
from ..files import bind_unix_private
from ..logs import RecurringCondition, RecurringConditions
from ..settings import Settings, StatusSettings, listen_address
from ..state import State
from .routes import StatusActions, build_app, error_json

log = logging.getLogger(__package__)


class StatusServerError(Exception):
    """One line naming the address and the problem."""


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StatusServerError(f"status.listen unix:{path}: exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # left by a daemon that died
        return
    except OSError as exc:
        problem = exc.strerror or str(exc)
        raise StatusServerError(f"status.listen unix:{path}: exists and cannot be probed: {problem}") from None
    finally:
        probe.close()
    raise StatusServerError(f"status.listen unix:{path}: another process is listening on it")


def bind_unix_socket(path: Path) -> socket.socket:
    """Its file never has a wider mode than 0660 (docs/status.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_socket(path)
    sock = bind_unix_private(path, 0o660)
    sock.setblocking(False)
    return sock


LISTEN_QUEUE = 511  # connections the kernel holds for us beyond those accepted, as nginx's default


class ConnectionGuard:
    """Against a slowloris flood: at most `limit` connections, each given `header_timeout_s` for
    its headers. At the limit, a new one closes the oldest yet to send a request, else is refused."""

    def __init__(self, limit: int, header_timeout_s: float) -> None:
        self.limit = limit
        self.header_timeout_s = header_timeout_s
        self.open: set[RequestHandler] = set()
        self.waiting: dict[RequestHandler, asyncio.TimerHandle] = {}  # oldest first
        self.at_limit = RecurringCondition(
            log, logging.WARNING, "status: %d connections open (status.max_connections): closing the oldest "
            "idle ones and refusing the rest",
        )
        self.too_slow = RecurringCondition(
            log, logging.WARNING, "status: closed a connection that sent no complete request within %g s "
            "(status.header_timeout_s)",
        )

    def admit(self, handler: RequestHandler) -> bool:
        if len(self.open) >= self.limit:
            self.at_limit.happened(len(self.open))
            if not self.waiting:
                return False
            oldest = next(iter(self.waiting))
            self.stop_timer(oldest)
            oldest.force_close()
        elif len(self.open) < self.limit // 2:
            self.at_limit.over("status: %d connections open, under the limit again", len(self.open))
        self.open.add(handler)
        loop = asyncio.get_running_loop()
        self.waiting[handler] = loop.call_later(self.header_timeout_s, self._header_timeout, handler)
        return True

    def closed(self, handler: RequestHandler) -> None:
        self.open.discard(handler)
        self.stop_timer(handler)

    def stop_timer(self, handler: RequestHandler) -> None:
        timer = self.waiting.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _header_timeout(self, handler: RequestHandler) -> None:
        if self.waiting.pop(handler, None) is not None:
            self.too_slow.happened(self.header_timeout_s)
            handler.force_close()


class _GuardedHandler(RequestHandler):
    """Under a ConnectionGuard, answering what aiohttp's parser refuses (a header over 8 KiB,
    for one) with `{"error": ...}`, no traceback."""

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **options: Any) -> None:
        super().__init__(manager, **options)
        self.guard = guard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self.guard.admit(self):
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.closed(self)
        super().connection_lost(exc)

    def request_started(self) -> None:
        self.guard.stop_timer(self)

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        self.guard.stop_timer(self)
        if request.writer.output_size > 0:  # an answer is already on its way: the connection is done
            raise ConnectionError("the response was already started")
        problem = " ".join(str(message or exc or "").split()) or HTTPStatus(status).phrase
        if status >= 500:
            log.warning("status: answering %d: %s", status, problem)
        else:
            log.debug("status: bad request from %s: %s", request.remote, problem)
        return error_json(status, f"bad request: {problem}" if status < 500 else problem, close=True)


def _descriptor_budget(limit: int) -> int:
    """At most a quarter of the file descriptors this process may open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or limit <= soft // 4:
        return limit
    budget = max(1, soft // 4)
    log.warning("status: status.max_connections=%d lowered to %d: the file descriptor limit is %d",
                limit, budget, soft)
    return budget


def _accepting(server: asyncio.Server | None) -> bool:
    """Whether every listening socket still listens: `ss -K` (or a conntrack flush) destroys one
    under us, and from then on it is readable for ever and every accept() fails with EINVAL."""
    sockets = server.sockets if server is not None and server.sockets else ()
    try:
        return all(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) for sock in sockets)
    except OSError:
        return False


class StatusListener:
    """The status app's socket and runner: bound by `open()`, again by `bind()` once `dead`."""

    def __init__(self, app: web.Application, listen: str, limits: StatusSettings) -> None:
        self.app = app
        self.listen = listen
        self.limits = limits
        self.address = listen_address(listen)
        # Scrapes every few seconds would flood an access log; operator actions are logged by the handlers.
        # An action in flight (a reload) may delay a stop by at most `shutdown_timeout`.
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
        self.server: asyncio.Server | None = None
        self.dead = asyncio.Event()
        self.problem = ""  # why it is dead
        self._inode: int | None = None  # the unix socket file we made
        self._guard: ConnectionGuard | None = None
        self._restore_exception_handler: Callable[[], None] = lambda: None

    async def open(self) -> None:
        if isinstance(self.address, str):
            self.app.on_cleanup.append(self._remove_socket_file)
        self.app.on_shutdown.append(self._stop_listening)
        loop = asyncio.get_running_loop()
        self._restore_exception_handler = quiet_loop_errors(loop, self._accept_failed)
        await self.runner.setup()
        self._guard = ConnectionGuard(_descriptor_budget(self.limits.max_connections), self.limits.header_timeout_s)
        try:
            await self.bind()
        except BaseException:
            await self.runner.cleanup()
            raise
        log.info("status: listening on %s", self.listen)

    async def bind(self) -> None:
        loop = asyncio.get_running_loop()
        server, guard = self.runner.server, self._guard
        assert server is not None and guard is not None
        limits = self.limits

        def connection() -> _GuardedHandler:
            # aiohttp's keep-alive timer closes a connection idle (or trickling) between requests;
            # the guard times the first request's headers. Both get header_timeout_s.
            return _GuardedHandler(
                server, guard, loop=loop, access_log=None, keepalive_timeout=limits.header_timeout_s,
                lingering_time=2.0,
            )

        # asyncio's `backlog` is both the kernel's queue and how many connections it accepts in one
        # wakeup, all before the guard sees the first: under a flood, three wakeups in flight
        # exhausted the descriptors at the guard's limit. A small batch keeps the guard's count
        # true; a long kernel queue keeps a real client's SYN from being dropped meanwhile.
        batch = max(1, guard.limit // 4)
        try:
            if isinstance(self.address, str):
                path = Path(self.address)
                sock = bind_unix_socket(path)
                self._inode = path.stat().st_ino
                listener = await loop.create_server(connection, sock=sock, backlog=batch)
            else:
                host, port = self.address
                listener = await loop.create_server(connection, host, port, reuse_address=True, backlog=batch)
            for listening in listener.sockets:
                with socket.socket(fileno=os.dup(listening.fileno())) as same:
                    same.listen(LISTEN_QUEUE)
        except OSError as exc:
            raise StatusServerError(f"status.listen {self.listen}: {exc.strerror or exc}") from None
        self.server = listener
        self.dead.clear()
        self.problem = ""

    def probe(self) -> bool:
        if self.dead.is_set():
            return False
        if _accepting(self.server):
            return True
        self._mark_dead("the listening socket was destroyed (it no longer accepts connections)")
        return False

    def _accept_failed(self, exc: BaseException) -> bool:
        """True when it was our listener failing (dealt with)."""
        if not isinstance(exc, OSError) or self.server is None or _accepting(self.server):
            return False
        self._mark_dead(f"accept() fails: {exc.strerror or exc}")
        return True

    def _mark_dead(self, problem: str) -> None:
        if self.dead.is_set():
            return
        self.problem = problem
        self._close_listener()  # removes its reader: a destroyed socket is readable for ever
        self.dead.set()

    def _close_listener(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    async def _stop_listening(self, _: web.Application) -> None:
        # Before aiohttp closes the open connections: no new one may arrive meanwhile.
        self._close_listener()
        self._restore_exception_handler()

    async def _remove_socket_file(self, _: web.Application) -> None:
        # Only our own file: a newer daemon may already listen on the same path.
        assert isinstance(self.address, str)
        path = Path(self.address)
        with contextlib.suppress(OSError):
            if path.stat().st_ino == self._inode:
                path.unlink()


def quiet_loop_errors(
    loop: asyncio.AbstractEventLoop, claimed: Callable[[BaseException], bool] = lambda _: False,
) -> Callable[[], None]:
    """An event loop exception handler logging the first error of a kind as asyncio does, its
    repeats once a minute with a count, unless `claimed(exc)`. Returns how to put the old one back."""
    previous = loop.get_exception_handler()
    out_of_resources = RecurringCondition(
        log, logging.ERROR, "status: cannot accept connections: %s; asyncio retries every second",
    )
    repeats = RecurringConditions(log, logging.ERROR)
    seen: set[str] = set()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = context.get("message", "")
        exc = context.get("exception")
        if message.startswith("socket.accept() out of system resource"):
            out_of_resources.happened(getattr(exc, "strerror", None) or exc)
            return
        if exc is not None and claimed(exc):
            return
        kind = f"{message.split('(')[0]}: {type(exc).__name__ if exc is not None else ''} {exc or ''}".strip()
        if kind in seen:
            repeats.happened(kind, kind, f"event loop: again: {kind}")
            return
        if len(seen) < 1000:
            seen.add(kind)
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return lambda: loop.set_exception_handler(previous)


class StatusServer:
    """The status app as a daemon component. A listening socket destroyed under it is noticed,
    logged once and bound again with a backoff; meanwhile State says the status API is down."""

    PROBE_S = 1.0
    REBIND_FIRST_S = 0.1
    REBIND_MAX_S = 5.0

    def __init__(self, settings: Settings, state: State, actions: StatusActions) -> None:
        self.settings = settings
        self.state = state
        self.actions = actions
        self._listener: StatusListener | None = None

    async def start(self) -> None:
        app = build_app(self.state, self.settings, self.actions)
        listener = StatusListener(app, self.settings.status.listen, self.settings.status)
        await listener.open()
        self._listener = listener

    async def run(self) -> None:
        listener = self._listener
        assert listener is not None, "start() first"
        try:
            while True:
                await wait_set(listener.dead, on_grid(self.PROBE_S))
                if listener.probe():
                    continue
                await self._bind_again(listener)
        finally:
            await self.stop()

    async def _bind_again(self, listener: StatusListener) -> None:
        listen = self.settings.status.listen
        down = f"status.listen {listen}: {listener.problem}"
        log.error("status: %s; binding it again", down)
        self.state.publish_status_listener(down)
        failing = RecurringCondition(log, logging.ERROR, "status: cannot bind again: %s; retrying")
        delay = self.REBIND_FIRST_S
        while True:
            try:
                await listener.bind()
                break
            except StatusServerError as exc:
                self.state.publish_status_listener(str(exc))
                failing.happened(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.REBIND_MAX_S)
        self.state.publish_status_listener(None)
        log.info("status: listening on %s again", listen)

    async def stop(self) -> None:
        """Unbind what `start()` bound; `run()` ends so, or never ran (a start cut short)."""
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await listener.runner.cleanup()
