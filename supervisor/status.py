"""The status HTTP app: /status, /metrics, /healthz, /readyz, the page, and the operator's actions.

It reads State and never changes it; operator actions (reload, mark a server dead) go
through the `actions` object the daemon passes in. What is shown is computed by pure
functions (`status_document`, `StateCollector`, and the page's in supervisor/page.py), so
they are unit-tested without a server.

Who may act: over TCP, `POST`/`DELETE` need `Authorization: Bearer <token>` with the
token from `status.token_file` (none configured: 403). On a unix socket there is no
token: the socket file is created 0660, so its owner and group decide who may connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import resource
import socket
import stat
from collections.abc import Awaitable, Callable, Iterable, Iterator
from datetime import datetime
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from . import __version__
from .files import read_regular
from .haproxy.api import validate_name
from .logs import RecurringCondition
from .page import BackendSizes, page_of
from .settings import Settings, StatusSettings, listen_address
from .state import Convergence, DurationHistogram, OldWorker, ReloadRecord, State, rfc3339, utcnow

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
MAX_TOKEN_BYTES = 64 * 1024
UNIX_SOCKET_MODE = 0o660
# The classic text format: every Prometheus version parses it (1.0.0 needs Prometheus 3).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Reload results that mean "the config HAProxy runs is what was asked for".
RELOAD_SUCCESS = frozenset({"ok", "runtime_applied", "skipped_unchanged"})
RELOAD_RESULTS = ("ok", "failed", "invalid", "skipped_unchanged", "runtime_applied", "unknown")


class StatusActions(Protocol):
    """What the daemon lets an operator do through HTTP."""

    async def reload_now(self) -> ReloadRecord | None:
        """Reload (forced, even if unchanged). The record of what happened, or None if only queued."""
        ...

    async def mark_dead(self, backend: str, server: str) -> None: ...

    async def unmark_dead(self, backend: str, server: str) -> None: ...

    def has_server(self, backend: str, server: str) -> bool:
        """True if the server exists in the current config or in a config an old worker runs."""
        ...


class StatusServerError(Exception):
    """The status listener could not be set up. One line naming the address and the problem."""


# ---------------------------------------------------------------- /status


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _reload_json(record: ReloadRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {
        "at": rfc3339(record.at),
        "result": record.result,
        "duration_ms": round(record.duration_ms, 3),
        "error": record.error,
    }


def _old_worker_json(worker: OldWorker, now: datetime) -> dict[str, Any]:
    return {
        "pid": worker.pid,
        "generation": worker.generation,
        "age_s": _seconds(worker.age_s(now)),
        "rss_bytes": worker.rss_bytes,
        "connections": worker.connections,
        "steered": sorted(worker.steered),
        "push": {"state": worker.push.state, "at": rfc3339(worker.push.at), "error": worker.push.error},
    }


def _oldest_first(workers: Iterable[OldWorker], now: datetime) -> list[OldWorker]:
    return sorted(workers, key=lambda w: (-(w.age_s(now) or 0.0), w.pid))


def status_document(state: State, settings: Settings, now: datetime) -> dict[str, Any]:
    """The /status JSON. Its keys are exactly those documented in README.md ("Status over HTTP")."""
    current = state.current
    reloads = state.reloads
    # The daemon resolves the binary into State; until it has, the configured name is the truth.
    binary = state.haproxy_binary if state.haproxy_binary != "haproxy" else settings.haproxy.binary
    return {
        "supervisor": {
            "pid": state.supervisor_pid,
            "version": __version__,
            "uptime_s": _seconds(max(0.0, (now - state.started_at).total_seconds())),
            "ready": not_ready_reason(state, settings.reload.converge_grace_s, now) is None,
        },
        "haproxy": {
            "version": state.haproxy_version,
            "master_pid": state.master_pid,
            "binary": binary,
            "up": state.master_up,
        },
        "worker": {
            "pid": current.worker_pid if current else None,
            "generation": current.number if current else None,
            "config_sha256": current.effective_sha256 if current else None,
            "started_at": rfc3339(current.started_at) if current else None,
        },
        "old_workers": [_old_worker_json(w, now) for w in _oldest_first(state.old_workers.values(), now)],
        "reloads": {
            **{result: getattr(reloads, result) for result in RELOAD_RESULTS},
            "last": _reload_json(reloads.last),
            "recent": [_reload_json(r) for r in reversed(reloads.history)],
        },
        "config": {
            "rendered_path": state.rendered_path or str(settings.haproxy.config),
            "rendered_sha256": state.rendered_sha256,
            "effective_path": state.effective_path or str(settings.haproxy.effective_config),
            "last_good_sha256": state.last_good_sha256,
        },
        "convergence": _convergence_json(state.convergence, now),
        "observe": {"enabled": settings.observe.enabled, "error_limit": settings.observe.error_limit},
        "dead_servers": sorted(state.dead_servers),
        "operator_dead": sorted(state.operator_dead),
    }


def _convergence_json(convergence: Convergence, now: datetime) -> dict[str, Any]:
    return {
        "converged": convergence.converged,
        "unconverged_s": _seconds(convergence.unconverged_s(now)),
        "since": rfc3339(convergence.unconverged_since),
        "reason": convergence.reason,
        "transient": convergence.transient,
        "attempts": convergence.attempts,
        "next_attempt_at": rfc3339(convergence.next_attempt_at),
    }


SOCKET_MISSING = "the HAProxy master's socket is missing from runtime_dir: the daemon is recreating it"


def not_ready_reason(state: State, grace_s: float = float("inf"), now: datetime | None = None) -> str | None:
    """Why /readyz says 503, or None when ready.

    Not converged for longer than `grace_s` (reload.converge_grace_s) is a reason when what stands
    in the way passes (convergence.transient), not when the config itself is the problem (invalid,
    or refused by HAProxy): HAProxy then serves the last good config, and a controller that
    rendered a bad config everywhere would otherwise empty the whole fleet.
    """
    if not state.master_socket_ok:
        return SOCKET_MISSING
    if not state.ready:
        if not state.master_up:
            return "HAProxy master is not running"
        current = state.current
        if current is None or current.worker_pid is None:
            return "no current worker yet"
        return "the current worker does not run the last good config"
    convergence = state.convergence
    waited = convergence.unconverged_s(now or utcnow())
    if convergence.transient and waited > grace_s:
        return f"not converged for {waited:.0f}s (reload.converge_grace_s={grace_s:g}): {convergence.reason}"
    return None


# ---------------------------------------------------------------- /metrics


def _histogram_buckets(histogram: DurationHistogram) -> list[tuple[str, float]]:
    counts = histogram.counts or [0] * len(histogram.bounds)
    buckets = [(repr(float(bound)), float(count)) for bound, count in zip(histogram.bounds, counts, strict=True)]
    buckets.append(("+Inf", float(histogram.count)))
    return buckets


class StateCollector(Collector):
    """Builds every haproxy_supervisor_* metric from State at scrape time; no global registry."""

    def __init__(
        self,
        state: State,
        clock: Callable[[], datetime] = utcnow,
        grace_s: float = float("inf"),
        old_workers_max: int | None = None,
    ) -> None:
        self.state = state
        self.clock = clock
        self.grace_s = grace_s
        self.old_workers_max = old_workers_max

    def collect(self) -> Iterator[Metric]:
        state, now = self.state, self.clock()
        reloads = state.reloads
        workers = list(state.old_workers.values())

        yield GaugeMetricFamily(
            "haproxy_supervisor_up", "1 while the HAProxy master runs (what /healthz reports), else 0.",
            value=1 if state.master_up else 0,
        )
        yield GaugeMetricFamily(
            "haproxy_supervisor_ready", "1 while /readyz says 200, else 0.",
            value=1 if not_ready_reason(state, self.grace_s, now) is None else 0,
        )
        yield GaugeMetricFamily(
            "haproxy_supervisor_converged",
            "1 while the current worker runs the effective config built from the rendered config, else 0.",
            value=1 if state.convergence.converged else 0,
        )
        yield GaugeMetricFamily(
            "haproxy_supervisor_unconverged_seconds",
            "Seconds the node has not run the rendered config; 0 when converged.",
            value=state.convergence.unconverged_s(now),
        )
        family = CounterMetricFamily(
            "haproxy_supervisor_reloads", "Config changes handled, by result.", labels=["result"],
        )
        for result in RELOAD_RESULTS:
            family.add_metric([result], getattr(reloads, result))
        yield family
        yield CounterMetricFamily(
            "haproxy_supervisor_runtime_applies",
            "Changes applied through the Runtime API without a reload.",
            value=reloads.runtime_applied,
        )
        generation = GaugeMetricFamily(
            "haproxy_supervisor_config_generation", "Generation number of the config the current worker runs.",
        )
        if state.current_generation is not None:
            generation.add_metric([], state.current_generation)
        yield generation
        yield GaugeMetricFamily(
            "haproxy_supervisor_old_workers", "Old (soft-stopped, draining) HAProxy workers alive.", value=len(workers),
        )
        if self.old_workers_max is not None:
            # Exported so that an alert can compare against the node's own cap, whatever it is set to.
            yield GaugeMetricFamily(
                "haproxy_supervisor_old_workers_max",
                "old_workers.max: past it the oldest old workers are sent SIGTERM.",
                value=self.old_workers_max,
            )
        ages = [age for w in workers if (age := w.age_s(now)) is not None]
        yield GaugeMetricFamily(
            "haproxy_supervisor_old_worker_oldest_age_seconds",
            "Age of the oldest old worker; 0 when there is none.",
            value=max(ages, default=0.0),
        )
        yield GaugeMetricFamily(
            "haproxy_supervisor_old_worker_connections",
            "Connections held by old workers, summed (unknown counts left out).",
            value=sum(w.connections or 0 for w in workers),
        )
        yield GaugeMetricFamily(
            "haproxy_supervisor_old_worker_rss_bytes",
            "Resident memory of old workers, summed (unknown sizes left out).",
            value=sum(w.rss_bytes or 0 for w in workers),
        )
        yield GaugeMetricFamily(
            "haproxy_supervisor_steered_servers",
            "Distinct backend/server pairs that at least one old worker is steered away from.",
            value=len({key for w in workers for key in w.steered}),
        )
        yield GaugeMetricFamily(
            "haproxy_supervisor_dead_servers", "Servers known dead, for any reason (operator included).",
            value=len(state.dead_servers),
        )
        yield HistogramMetricFamily(
            "haproxy_supervisor_push_duration_seconds",
            "Time to work out and push the old workers' steer-map entries through the master CLI, per push round.",
            buckets=_histogram_buckets(state.push_duration),
            sum_value=state.push_duration.sum,
        )
        yield CounterMetricFamily(
            "haproxy_supervisor_push_failures", "Pushes to old workers that failed.", value=state.push_failures,
        )
        yield CounterMetricFamily(
            "haproxy_supervisor_master_restarts", "Times the HAProxy master was restarted after it died.",
            value=state.master_restarts,
        )
        yield GaugeMetricFamily(
            "haproxy_supervisor_event_loop_lag_seconds",
            "The worst delay of the daemon's event loop over the last 10 to 20 s: how late any task ran.",
            value=state.event_loop_lag_s,
        )


def metrics_registry(
    state: State,
    clock: Callable[[], datetime] = utcnow,
    grace_s: float = float("inf"),
    old_workers_max: int | None = None,
) -> CollectorRegistry:
    """A private registry: the State collector plus this process's own process_* metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(state, clock, grace_s, old_workers_max))
    ProcessCollector(registry=registry)
    return registry


# ---------------------------------------------------------------- the app


BODY_TIMEOUT_KEY = web.AppKey("body_timeout_s", float)


class _Refused(Exception):
    """An answer of `{"error": message}` with an HTTP status."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def load_token(token_file: Path | None) -> tuple[bytes | None, str]:
    """The bearer token, or None with the reason POST/DELETE over TCP are refused."""
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


def _error_json(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except _Refused as refused:
        return _error_json(refused.status, refused.message, refused.headers)
    except web.HTTPRequestEntityTooLarge:
        return _error_json(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    except web.HTTPNotFound:
        return _error_json(404, f"no such endpoint: {request.method} {request.path}")
    except web.HTTPMethodNotAllowed as exc:
        allow = ", ".join(sorted(exc.allowed_methods))
        return _error_json(405, f"{request.method} not allowed on {request.path} (allowed: {allow})", {"Allow": allow})
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_json(exc.status, exc.reason)
    except ConnectionError:
        # The client left mid-request (mid-body, usually): nobody to answer, nothing to report.
        log.debug("status: %s %s: the client disconnected", request.method, request.path)
        return _error_json(400, "the client disconnected")
    except Exception as exc:
        log.exception("status: %s %s failed", request.method, request.path)
        return _error_json(500, f"internal error: {type(exc).__name__}: {exc}")


@web.middleware
async def _bounded_body(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    # The headers are in: the header timer stops, the body timer starts.
    if isinstance(request.protocol, _GuardedHandler):
        request.protocol.request_started()
    # Handlers ignore bodies, and aiohttp enforces client_max_size only while reading one:
    # read it here so an oversized body is answered 413 on every route, and a body that is
    # announced but never sent (Content-Length: 10^12) does not hold the connection.
    if request.can_read_body:
        if (request.content_length or 0) > MAX_BODY_BYTES:
            return _closing(_error_json(413, f"request body larger than {MAX_BODY_BYTES} bytes"))
        timeout = request.app[BODY_TIMEOUT_KEY]
        try:
            await asyncio.wait_for(request.read(), timeout)
        except TimeoutError:
            return _closing(_error_json(408, f"request body not received within {timeout:g} s"))
        except web.HTTPRequestEntityTooLarge:
            return _closing(_error_json(413, f"request body larger than {MAX_BODY_BYTES} bytes"))
    return await handler(request)


def _closing(response: web.Response) -> web.Response:
    # The rest of an unread body would be taken for the next request: end the connection.
    response.force_close()
    return response


class _Endpoints:
    def __init__(
        self, state: State, settings: Settings, actions: StatusActions, clock: Callable[[], datetime]
    ) -> None:
        self.state = state
        self.settings = settings
        self.actions = actions
        self.clock = clock
        self.token, self.token_problem = load_token(settings.status.token_file)
        self.registry = metrics_registry(state, clock, settings.reload.converge_grace_s, settings.old_workers.max)
        self.backend_sizes = BackendSizes()

    # -- reads

    async def status(self, request: web.Request) -> web.Response:
        # Compact: a big drain (many old workers, each steered from thousands of servers) makes
        # a document of megabytes built on this event loop; indenting would double its size and
        # time. `jq` or `status --json` pretty-print.
        return web.json_response(status_document(self.state, self.settings, self.clock()))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def healthz(self, request: web.Request) -> web.Response:
        if not self.state.master_up:
            return _error_json(503, "HAProxy master is not running")
        if not self.state.master_socket_ok:
            return _error_json(503, SOCKET_MISSING)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        reason = not_ready_reason(self.state, self.settings.reload.converge_grace_s, self.clock())
        if reason is not None:
            return _error_json(503, reason)
        return web.json_response({"status": "ready"})

    async def page(self, request: web.Request) -> web.Response:
        now = self.clock()
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

    # -- actions

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

    def server_from(self, request: web.Request) -> tuple[str, str]:
        backend, server = request.match_info["backend"], request.match_info["server"]
        try:
            validate_name("backend", backend)
            validate_name("server", server)
        except ValueError as exc:
            raise _Refused(400, str(exc)) from None
        return backend, server

    async def reload(self, request: web.Request) -> web.Response:
        self.authorize(request)
        log.info("status: reload requested by an operator (%s)", _peer(request))
        record = await self.actions.reload_now()
        if record is None:
            return web.json_response({"reload": "queued"}, status=202)
        body = {"reload": _reload_json(record)}
        if record.result in RELOAD_SUCCESS:
            return web.json_response(body)
        return web.json_response({"error": f"reload {record.result}: {record.error or 'see the log'}", **body},
                                 status=500)

    async def mark_dead(self, request: web.Request) -> web.Response:
        self.authorize(request)
        backend, server = self.server_from(request)
        if not self.actions.has_server(backend, server):
            raise _Refused(404, f"no server {backend}/{server} in any config HAProxy runs")
        log.info("status: %s/%s marked dead by an operator (%s)", backend, server, _peer(request))
        await self.actions.mark_dead(backend, server)
        return web.json_response({"server": f"{backend}/{server}", "operator_dead": True})

    async def unmark_dead(self, request: web.Request) -> web.Response:
        self.authorize(request)
        backend, server = self.server_from(request)
        key = f"{backend}/{server}"
        # A server that left every config may still be marked; it must stay possible to clear it.
        if not self.actions.has_server(backend, server) and key not in self.state.operator_dead:
            raise _Refused(404, f"no server {key} in any config HAProxy runs")
        log.info("status: %s no longer marked dead by an operator (%s)", key, _peer(request))
        await self.actions.unmark_dead(backend, server)
        return web.json_response({"server": key, "operator_dead": False})


def build_app(
    state: State, settings: Settings, actions: StatusActions, clock: Callable[[], datetime] = utcnow
) -> web.Application:
    """The status app. The token file is read here, once; an unreadable one is logged."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors, _bounded_body])
    app[BODY_TIMEOUT_KEY] = settings.status.body_timeout_s
    endpoints = _Endpoints(state, settings, actions, clock)
    if endpoints.token is None and not settings.status.listen.startswith("unix:"):
        log.info("status: %s", endpoints.token_problem)
    app.router.add_get("/", endpoints.page)
    app.router.add_get("/status", endpoints.status)
    app.router.add_get("/metrics", endpoints.metrics)
    app.router.add_get("/healthz", endpoints.healthz)
    app.router.add_get("/readyz", endpoints.readyz)
    app.router.add_post("/reload", endpoints.reload)
    app.router.add_post("/servers/{backend}/{server}/dead", endpoints.mark_dead)
    app.router.add_delete("/servers/{backend}/{server}/dead", endpoints.unmark_dead)
    return app


# ---------------------------------------------------------------- listening


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
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # bind() creates the file as 0777 & ~umask. Narrowing the umask around it leaves no
        # moment when another user could connect; nothing else runs in this process meanwhile.
        previous = os.umask(0o777 & ~mode)
        try:
            sock.bind(str(path))
        finally:
            os.umask(previous)
        os.chmod(path, mode)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
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
        response = _error_json(status, f"bad request: {problem}" if status < 500 else problem)
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
    """The status app as a daemon component: serves from `run()` until cancelled."""

    def __init__(self, settings: Settings, state: State, actions: StatusActions) -> None:
        self.settings = settings
        self.state = state
        self.actions = actions

    RETRY_S = 5.0

    async def run(self) -> None:
        # A busy port must not take HAProxy down with the daemon: keep serving traffic, say why
        # the status endpoint is missing, and try again.
        while True:
            try:
                # A fresh app each try: a runner that failed has already cleaned its app up.
                app = build_app(self.state, self.settings, self.actions)
                runner = await start_status_server(app, self.settings.status.listen, self.settings.status)
                break
            except StatusServerError as exc:
                log.error("%s; retrying in %.0f s", exc, self.RETRY_S)
                await asyncio.sleep(self.RETRY_S)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
