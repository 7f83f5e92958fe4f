"""The hardened listener the app is served on: TCP or a unix socket (0660), a connection limit
within the descriptor budget, a header timeout; and `StatusServer`, the daemon component."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import stat
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ..files import bind_unix_private
from ..logs import RecurringCondition
from ..settings import Settings, StatusSettings, listen_address
from ..state import State
from .routes import StatusActions, build_app, error_json

log = logging.getLogger(__package__)


UNIX_SOCKET_MODE = 0o660


class StatusServerError(Exception):
    """The status listener could not be set up. One line naming the address and the problem."""


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


def bind_unix_socket(path: Path, mode: int = UNIX_SOCKET_MODE) -> socket.socket:
    """A listening-ready unix socket whose file never has a wider mode than `mode`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_socket(path)
    sock = bind_unix_private(path, mode)
    sock.setblocking(False)
    return sock


class ConnectionGuard:
    """The status listener's limits on clients: at most `limit` connections, and each gets
    `header_timeout_s` to send a request's headers. A slowloris flood (connections that
    trickle or send nothing) would otherwise hold every file descriptor the daemon has.

    At the limit, a new connection closes the oldest one that has not sent a request yet (a
    real client sends its request at once, so it is rarely the oldest); if every connection
    is busy with a request, the new one is refused."""

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
            self._stop_waiting(oldest)
            oldest.force_close()
        elif len(self.open) < self.limit // 2:
            self.at_limit.over("status: %d connections open, under the limit again", len(self.open))
        self.open.add(handler)
        loop = asyncio.get_running_loop()
        self.waiting[handler] = loop.call_later(self.header_timeout_s, self._header_timeout, handler)
        return True

    def request_started(self, handler: RequestHandler) -> None:
        self._stop_waiting(handler)

    def closed(self, handler: RequestHandler) -> None:
        self.open.discard(handler)
        self._stop_waiting(handler)

    def _stop_waiting(self, handler: RequestHandler) -> None:
        timer = self.waiting.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _header_timeout(self, handler: RequestHandler) -> None:
        if self.waiting.pop(handler, None) is not None:
            self.too_slow.happened(self.header_timeout_s)
            handler.force_close()


class _GuardedHandler(RequestHandler):
    """aiohttp's connection handler under a ConnectionGuard, answering the requests aiohttp's
    own parser refuses (a header over 8 KiB, an unknown method, a negative Content-Length)
    with `{"error": ...}` like every other refusal, and without a traceback."""

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
        self.guard.request_started(self)

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        self.guard.request_started(self)
        if request.writer.output_size > 0:  # an answer is already on its way: the connection is done
            raise ConnectionError("the response was already started")
        problem = " ".join(str(message or exc or "").split()) or HTTPStatus(status).phrase
        if status >= 500:
            log.warning("status: answering %d: %s", status, problem)
        else:
            log.debug("status: bad request from %s: %s", request.remote, problem)
        response = error_json(status, f"bad request: {problem}" if status < 500 else problem)
        response.force_close()
        return response


def _descriptor_budget(limit: int) -> int:
    """The connection limit, kept to a quarter of the file descriptors this process may open:
    the rest are for HAProxy's sockets, `haproxy -c` and the files the daemon writes."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or limit <= soft // 4:
        return limit
    budget = max(1, soft // 4)
    log.warning("status: status.max_connections=%d lowered to %d: the file descriptor limit is %d",
                limit, budget, soft)
    return budget


def _quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """asyncio reports each accept() that fails for lack of file descriptors with a traceback;
    make that one line per minute. Returns the function that puts the previous handler back."""
    previous = loop.get_exception_handler()
    out_of_resources = RecurringCondition(
        log, logging.ERROR, "status: cannot accept connections: %s; asyncio retries every second",
    )

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message", "").startswith("socket.accept() out of system resource"):
            exc = context.get("exception")
            out_of_resources.happened(getattr(exc, "strerror", None) or exc)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return lambda: loop.set_exception_handler(previous)


async def start_status_server(
    app: web.Application, listen: str, limits: StatusSettings | None = None
) -> web.AppRunner:
    """Serve `app` on `host:port` or `unix:/path`. Stop it with `await runner.cleanup()`."""
    limits = limits or StatusSettings()
    address = listen_address(listen)
    # Scrapes every few seconds would flood an access log; operator actions are logged by the handlers.
    # An action in flight (a reload) may delay a stop by at most `shutdown_timeout`.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
    sock: socket.socket | None = None
    if isinstance(address, str):
        path = Path(address)
        try:
            sock = bind_unix_socket(path)
        except OSError as exc:
            raise StatusServerError(f"status.listen {listen}: {exc.strerror or exc}") from None
        inode = path.stat().st_ino

        async def remove_socket_file(_: web.Application) -> None:
            # Only our own file: a newer daemon may already listen on the same path.
            with contextlib.suppress(OSError):
                if path.stat().st_ino == inode:
                    path.unlink()

        app.on_cleanup.append(remove_socket_file)
    listening: list[asyncio.Server] = []
    loop = asyncio.get_running_loop()
    restore_exception_handler = _quiet_accept_errors(loop)

    async def stop_listening(_: web.Application) -> None:
        # Before aiohttp closes the open connections: no new one may arrive meanwhile.
        for listener in listening:
            listener.close()
        restore_exception_handler()

    app.on_shutdown.append(stop_listening)
    await runner.setup()
    server = runner.server
    assert server is not None
    guard = ConnectionGuard(_descriptor_budget(limits.max_connections), limits.header_timeout_s)

    def connection() -> _GuardedHandler:
        # aiohttp's keep-alive timer closes a connection idle (or trickling) between requests;
        # the guard times the first request's headers. Both get header_timeout_s.
        return _GuardedHandler(
            server, guard, loop=loop, access_log=None, keepalive_timeout=limits.header_timeout_s, lingering_time=2.0,
        )

    try:
        if sock is not None:
            listener = await loop.create_server(connection, sock=sock)
        else:
            host, port = address
            listener = await loop.create_server(connection, host, port, reuse_address=True)
    except OSError as exc:
        await runner.cleanup()
        raise StatusServerError(f"status.listen {listen}: {exc.strerror or exc}") from None
    except BaseException:
        await runner.cleanup()
        raise
    listening.append(listener)
    log.info("status: listening on %s", listen)
    return runner


class StatusServer:
    """The status app as a daemon component: `start()` binds (StatusServerError when it cannot:
    the daemon stops before it says READY=1), `run()` serves until cancelled."""

    def __init__(self, settings: Settings, state: State, actions: StatusActions) -> None:
        self.settings = settings
        self.state = state
        self.actions = actions
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = build_app(self.state, self.settings, self.actions)
        self._runner = await start_status_server(app, self.settings.status.listen, self.settings.status)

    async def run(self) -> None:
        if self._runner is None:
            await self.start()
        runner = self._runner
        assert runner is not None
        try:
            await asyncio.Event().wait()
        finally:
            self._runner = None
            await runner.cleanup()

    async def stop(self) -> None:
        """Close a listener that `start()` bound and `run()` never served (a start cut short)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
