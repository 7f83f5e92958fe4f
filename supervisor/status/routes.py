"""The aiohttp app: its endpoints, who may act, bounded request bodies, errors as one JSON line."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import socket
import stat
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Protocol

from aiohttp import web
from prometheus_client.exposition import generate_latest

from ..files import read_regular
from ..haproxy.answers import ServerKey
from ..haproxy.resolution import is_ip
from ..page import BackendSizes, page_of
from ..settings import Settings, listen_address
from ..state import ReloadRecord, State, utcnow
from .document import (
    METRICS_CONTENT_TYPE,
    SOCKET_MISSING,
    metrics_registry,
    not_ready_reason,
    reload_json,
    status_document,
)

log = logging.getLogger(__package__)


MAX_BODY_BYTES = 64 * 1024
MAX_TOKEN_BYTES = 64 * 1024
# Reload results that mean "the config HAProxy runs is what was asked for".
RELOAD_SUCCESS = frozenset({"ok", "runtime_applied", "skipped_unchanged"})


class StatusActions(Protocol):
    async def reload_now(self) -> ReloadRecord | None:
        """Reload (forced, even if unchanged). The record of what happened, or None if only queued."""

    async def mark_dead(self, backend: str, server: str) -> None: ...

    async def unmark_dead(self, backend: str, server: str) -> None: ...

    def has_server(self, backend: str, server: str) -> bool:
        """In the current config or in a config an old worker runs."""


BODY_TIMEOUT_KEY = web.AppKey("body_timeout_s", float)


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def load_token(token_file: Path | None) -> tuple[bytes | None, str]:
    """The bearer token, or None and why POST/DELETE over TCP are refused."""
    if token_file is None:
        return None, "no status.token_file is configured: POST and DELETE are refused over TCP"
    try:
        token = read_regular(token_file, MAX_TOKEN_BYTES).strip()  # a FIFO there must not hang the start
        mode = token_file.stat().st_mode
    except OSError as exc:
        log.error("status.token_file %s: cannot read: %s; POST and DELETE over TCP will answer 403",
                  token_file, exc.strerror or exc)
        return None, f"status.token_file {token_file} could not be read at start"
    if not token:
        log.error("status.token_file %s is empty; POST and DELETE over TCP will answer 403", token_file)
        return None, f"status.token_file {token_file} is empty"
    if mode & stat.S_IROTH:
        log.warning("status.token_file %s is readable by every user; chmod 0600 or 0640 it", token_file)
    return token, ""


def _on_unix_socket(request: web.Request) -> bool:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def _peer(request: web.Request) -> str:
    return "unix socket" if _on_unix_socket(request) else str(request.remote)


def error_json(status: int, message: str, headers: dict[str, str] | None = None, close: bool = False) -> web.Response:
    response = web.json_response({"error": message}, status=status, headers=headers)
    if close:  # the rest of an unread body would be taken for the next request: end the connection
        response.force_close()
    return response


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except _Refused as refused:
        return error_json(refused.status, refused.message, refused.headers)
    except web.HTTPNotFound:
        return error_json(404, f"no such endpoint: {request.method} {request.path}")
    except web.HTTPMethodNotAllowed as exc:
        allow = ", ".join(sorted(exc.allowed_methods))
        return error_json(405, f"{request.method} not allowed on {request.path} (allowed: {allow})", {"Allow": allow})
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_json(exc.status, exc.reason)
    except ConnectionError:
        # The client left mid-request (mid-body, usually): nobody to answer, nothing to report.
        log.debug("status: %s %s: the client disconnected", request.method, request.path)
        return error_json(400, "the client disconnected")
    except Exception as exc:
        log.exception("status: %s %s failed", request.method, request.path)
        return error_json(500, f"internal error: {type(exc).__name__}: {exc}")


@web.middleware
async def _bounded_body(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    # The headers are in: the listener's header timer stops, the body timer starts.
    if (request_started := getattr(request.protocol, "request_started", None)) is not None:
        request_started()
    # Handlers ignore bodies, and aiohttp enforces client_max_size only while reading one:
    # read it here so an oversized body is answered 413 on every route, and a body that is
    # announced but never sent (Content-Length: 10^12) does not hold the connection.
    if request.can_read_body:
        timeout = request.app[BODY_TIMEOUT_KEY]
        try:
            if (request.content_length or 0) > MAX_BODY_BYTES:
                raise web.HTTPRequestEntityTooLarge(MAX_BODY_BYTES, request.content_length or 0)
            async with asyncio.timeout(timeout):
                await request.read()
        except TimeoutError:
            return error_json(408, f"request body not received within {timeout:g} s", close=True)
        except web.HTTPRequestEntityTooLarge:
            return error_json(413, f"request body larger than {MAX_BODY_BYTES} bytes", close=True)
    return await handler(request)


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def host_of(header: str) -> str:
    """Lowercased, without its port or an IPv6 literal's brackets."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    host, _, port = value.rpartition(":")
    if host and port.isdigit() and ":" not in host:
        return host
    return value


def host_allowed(header: str, listen_host: str, allowed: Iterable[str]) -> bool:
    """Whether this Host names this listener: a DNS name not ours is how a web page reads the
    API through DNS rebinding. Any IP address is accepted, as are loopback names."""
    host = host_of(header)
    if not host or len(host) > 253:
        return False
    if is_ip(host) or host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    return host == listen_host.lower() or host in {a.strip().lower() for a in allowed}


def _host_check(listen_host: str, allowed: tuple[str, ...]) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if _on_unix_socket(request):
            return await handler(request)  # no browser reaches a unix socket
        header = request.headers.getall("Host", [])
        if not header:
            return await handler(request)  # HTTP/1.0 without Host: not a browser
        if len(header) > 1 or not host_allowed(header[0], listen_host, allowed):
            shown = header[0][:80]
            log.debug("status: refused Host %r from %s", shown, _peer(request))
            message = f"this listener does not answer for Host {shown!r} (status.allowed_hosts)"
            return error_json(421, message, close=True)
        return await handler(request)

    return check


class _Endpoints:
    def __init__(self, state: State, settings: Settings, actions: StatusActions) -> None:
        self.state = state
        self.settings = settings
        self.actions = actions
        self.token, self.token_problem = load_token(settings.status.token_file)
        self.registry = metrics_registry(state, utcnow, settings.reload.converge_grace_s, settings.old_workers.max)
        self.backend_sizes = BackendSizes()

    async def status(self, request: web.Request) -> web.Response:
        # Compact: a big drain (many old workers, each steered from thousands of servers) makes
        # a document of megabytes built on this event loop; indenting would double its size and
        # time. `jq` or `status --json` pretty-print.
        return web.json_response(status_document(self.state, self.settings, utcnow()))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def healthz(self, request: web.Request) -> web.Response:
        if not self.state.master_up:
            return error_json(503, "HAProxy master is not running")
        if not self.state.master_socket_ok:
            return error_json(503, SOCKET_MISSING)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        reason = not_ready_reason(self.state, self.settings.reload.converge_grace_s, utcnow())
        if reason is not None:
            return error_json(503, reason)
        return web.json_response({"status": "ready"})

    async def page(self, request: web.Request) -> web.Response:
        now = utcnow()
        body = page_of(self.state, status_document(self.state, self.settings, now), now, self.backend_sizes)
        return web.Response(
            text=body,
            content_type="text/html",
            headers={
                "Cache-Control": "no-store",
                # The page needs nothing from anywhere: no scripts, no fetches, inline style only.
                "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
            },
        )

    def authorize(self, request: web.Request) -> None:
        if _on_unix_socket(request):
            return  # the socket file's mode already decided who could connect
        if self.token is None:
            raise _Refused(403, self.token_problem)
        header = request.headers.get("Authorization")
        if not header:
            raise _Refused(403, "this endpoint needs Authorization: Bearer <token> (status.token_file)")
        scheme, _, presented = header.partition(" ")
        # aiohttp decodes headers with surrogateescape; encode the same way to get the bytes sent.
        presented_bytes = presented.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented_bytes, self.token):
            log.warning("status: %s %s from %s: wrong bearer token", request.method, request.path, _peer(request))
            raise _Refused(401, "wrong bearer token", {"WWW-Authenticate": 'Bearer realm="haproxy-supervisor"'})

    async def reload(self, request: web.Request) -> web.Response:
        self.authorize(request)
        log.info("status: reload requested by an operator (%s)", _peer(request))
        record = await self.actions.reload_now()
        if record is None:
            return web.json_response({"reload": "queued"}, status=202)
        body = {"reload": reload_json(record)}
        if record.result in RELOAD_SUCCESS:
            return web.json_response(body)
        return web.json_response({"error": f"reload {record.result}: {record.error or 'see the log'}", **body},
                                 status=500)

    async def operator_dead(self, request: web.Request, dead: bool) -> web.Response:
        self.authorize(request)
        try:
            key = ServerKey.checked(request.match_info["backend"], request.match_info["server"])
        except ValueError as exc:
            raise _Refused(400, str(exc)) from None
        # A server that left every config may still be marked; it must stay possible to clear it.
        if not self.actions.has_server(key.backend, key.server) and (dead or key not in self.state.operator_dead):
            raise _Refused(404, f"no server {key} in any config HAProxy runs")
        marked = "marked dead" if dead else "no longer marked dead"
        log.info("status: %s %s by an operator (%s)", key, marked, _peer(request))
        await (self.actions.mark_dead if dead else self.actions.unmark_dead)(key.backend, key.server)
        return web.json_response({"server": key, "operator_dead": dead})


def build_app(state: State, settings: Settings, actions: StatusActions) -> web.Application:
    """The token file is read here, once."""
    listen = listen_address(settings.status.listen)
    middlewares = [_json_errors, _bounded_body]
    if not isinstance(listen, str):
        middlewares.insert(1, _host_check(listen[0], settings.status.allowed_hosts))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[BODY_TIMEOUT_KEY] = settings.status.body_timeout_s
    endpoints = _Endpoints(state, settings, actions)
    if endpoints.token is None and not isinstance(listen, str):
        log.info("status: %s", endpoints.token_problem)
    app.router.add_get("/", endpoints.page)
    app.router.add_get("/status", endpoints.status)
    app.router.add_get("/metrics", endpoints.metrics)
    app.router.add_get("/healthz", endpoints.healthz)
    app.router.add_get("/readyz", endpoints.readyz)
    app.router.add_post("/reload", endpoints.reload)
    app.router.add_post("/servers/{backend}/{server}/dead", functools.partial(endpoints.operator_dead, dead=True))
    app.router.add_delete("/servers/{backend}/{server}/dead", functools.partial(endpoints.operator_dead, dead=False))
    return app
