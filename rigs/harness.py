"""Real processes and sockets for end-to-end tests: HAProxy, backends, vanished nodes, clients.

Everything listens on or connects to 127.0.0.1 only. Every process started here is
stopped by PID by the fixture that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
BACKEND_SCRIPT = ROOT / "demo" / "backend.py"


def haproxy_binary() -> str:
    """The HAProxy the suite runs: $HAPROXY_BIN (`make test-all` sets it per version), else the
    one on PATH, else Debian's."""
    chosen = os.environ.get("HAPROXY_BIN")
    if chosen:
        found = shutil.which(chosen)
        if not found:
            raise RuntimeError(f"HAPROXY_BIN={chosen}: not an executable file")
        return str(Path(found).resolve())
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if not found:
        raise RuntimeError("haproxy is not installed: run `make test`, which installs Debian's package")
    return found


def short_tmpdir(prefix: str = "hs-") -> Path:
    """Unix socket paths must stay under 108 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@functools.cache
def _port_slice() -> range:
    """This process's ports: below the kernel's ephemeral range, so no outgoing connection can
    take one between the test choosing it and HAProxy binding it, and split between pytest-xdist
    workers, so two workers never choose the same one."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    start, end = (10000, low) if low - 10000 >= 4000 else (high + 1, 65536)
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = (end - start) // count
    return range(start + index * size, start + (index + 1) * size)


_next_port = 0


def free_port() -> int:
    """A loopback TCP port nothing holds, not handed out before by this process's cycle."""
    global _next_port
    ports = _port_slice()
    for _ in range(len(ports)):
        port = ports[_next_port % len(ports)]
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1}")


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
    """Stop a process we started, by its PID, and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (HAProxy workers, old ones included)."""
    try:
        parent = psutil.Process(pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=5)


@dataclass
class Backend:
    """A tiny HTTP server process on 127.0.0.1 that answers with its name."""

    name: str
    port: int
    proc: subprocess.Popen | None = None

    def start(self) -> Backend:
        self.proc = subprocess.Popen(
            [sys.executable, str(BACKEND_SCRIPT), str(self.port), self.name],
            stdout=subprocess.DEVNULL,
        )
        wait_for(lambda: port_open(self.port), what=f"backend {self.name} on port {self.port}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class VanishedNode:
    """A port where connects hang, like a node that vanished from the network.

    A listener with backlog 0 whose accept queue is filled by connections we never
    accept: the kernel then drops new SYNs, so connects time out instead of being
    refused (a killed local server would answer with a reset at once).
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(0)
        self.fillers: list[socket.socket] = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            self.fillers.append(s)
        time.sleep(0.05)

    def connect_hangs(self, timeout: float = 0.3) -> bool:
        with socket.socket() as s:
            s.settimeout(timeout)
            try:
                s.connect(("127.0.0.1", self.port))
            except TimeoutError:
                return True
            except OSError:
                return False
            return False

    def close(self) -> None:
        for s in self.fillers:
            s.close()
        self.listener.close()


def _is_show(command: str) -> bool:
    """`show ...`, or `@!<pid> show ...` / `@<n> show ...`: safe to send twice."""
    words = command.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return bool(words) and words[0] == "show"


class HAProxyMaster:
    """`haproxy -W -S <sock> -f <cfg>` as our child; stopped (with every worker) by PID."""

    def __init__(self, config: Path, runtime: Path) -> None:
        self.config = config
        self.runtime = runtime
        self.socket = runtime / "master.sock"
        self.pid_file = runtime / "haproxy.pid"
        self.proc: subprocess.Popen | None = None

    def start(self) -> HAProxyMaster:
        # stderr to a file, not a pipe: workers print a line per server state change there
        # (`Server b/s is UP/READY ...`), and a pipe nobody reads blocks them after 64 KiB.
        self.stderr_path = self.runtime / "haproxy.stderr"
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [haproxy_binary(), "-W", "-S", str(self.socket), "-f", str(self.config), "-p", str(self.pid_file)],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        wait_for(lambda: self.socket.exists() or self.proc.poll() is not None, what="master socket")
        if self.proc.poll() is not None:
            raise RuntimeError(f"haproxy exited: {self.stderr_path.read_text(errors='replace')}")
        wait_for(self.ready_worker, what="first worker ready")
        return self

    def command(self, line: str, timeout: float = 5.0) -> str:
        """A blocking master-CLI round trip (the daemon uses the async client)."""
        deadline = time.monotonic() + timeout
        # The master re-executes itself after start-up and on reload. Its socket is briefly
        # closed (refused), and a connection it had accepted or queued but not read is dropped:
        # our write fails (broken pipe) or our read does (reset, our bytes left unread). Either
        # way the line never ran: it is sent again, whatever it is. A read whose line the master
        # had read when it re-executed gets an empty answer: it is sent again too.
        read_only = all(_is_show(command) for command in line.split(";"))
        while True:
            try:
                answer = self._roundtrip(line, timeout)
                if answer or not read_only:
                    return answer
            except (ConnectionRefusedError, FileNotFoundError, BrokenPipeError, ConnectionResetError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"master CLI {self.socket}: no answer to {line!r} in {timeout}s")
            time.sleep(0.02)

    def _roundtrip(self, line: str, timeout: float) -> str:
        chunks: list[bytes] = []
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(str(self.socket))
            s.sendall(line.encode() + b"\n")
            s.shutdown(socket.SHUT_WR)
            try:
                while chunk := s.recv(65536):
                    chunks.append(chunk)
            except ConnectionResetError:
                if chunks:  # cut short mid-answer: not a line left unread
                    raise ConnectionError(f"master CLI {self.socket}: answer to {line!r} cut short") from None
                raise
        return b"".join(chunks).decode()

    def worker_pids(self) -> tuple[int | None, list[int]]:
        from supervisor.haproxy.answers import parse_show_proc

        procs = parse_show_proc(self.command("show proc"))
        current = procs.current_worker
        return (current.pid if current else None), [p.pid for p in procs.old_workers]

    def ready_worker(self) -> int | None:
        """The current worker's PID once it answers through the master: from 3.1 on, `show proc`
        lists a worker before it has loaded its config and bound its ports."""
        pid, _ = self.worker_pids()
        if pid is None:
            return None
        try:
            info = self.command(f"@!{pid} show info", timeout=1)
        except OSError:  # a timeout: the worker cannot answer yet
            return None
        return pid if f"\nPid: {pid}\n" in f"\n{info}" else None

    def reload(self) -> int:
        """Reload and wait for a new worker, ready; returns its PID."""
        before, _ = self.worker_pids()
        self.command("reload")
        return wait_for(
            lambda: (pid := self.ready_worker()) not in (None, before) and pid,
            timeout=10,
            what="new worker ready after reload",
        )

    def stop(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)


class KeepAliveClient:
    """One HTTP/1.1 keep-alive connection, so a test knows which worker serves it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        # Set when a response said `connection: close` (an old worker winding its connections
        # down over close-spread-time): the answer was good, but no request may follow it.
        self.closing = False
        self.last_error: str | None = None  # why the last get() answered status 0
        self.answered = 0  # requests answered on this connection
        # The last get() met the connection closed before a byte of its answer, after earlier
        # answers: the keep-alive race (RFC 9112 9.3.1), which HAProxy passes on silently
        # when a reused server connection closes under a request. A client retries it.
        self.closed_before_answer = False

    async def connect(self) -> KeepAliveClient:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def get(self, path: str = "/", host: str = "test", timeout: float = 10.0) -> tuple[int, str, float]:
        """(status, body, seconds). Status 0 when the connection closed or timed out."""
        assert self.reader is not None and self.writer is not None
        started = time.monotonic()
        self.closed_before_answer = False
        try:
            self.writer.write(f"GET {path} HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
            await self.writer.drain()
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                key, _, value = line.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value)
                if key.strip().lower() == b"connection" and value.strip().lower() == b"close":
                    self.closing = True
            body = await asyncio.wait_for(self.reader.readexactly(length), timeout) if length else b""
            self.answered += 1
            return status, body.decode().strip(), time.monotonic() - started
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            self.last_error = repr(exc)
            if isinstance(exc, asyncio.IncompleteReadError) and not exc.partial and self.answered:
                self.closed_before_answer = True
            return 0, "", time.monotonic() - started

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()


@contextlib.contextmanager
def backends(*names: str) -> Iterator[dict[str, Backend]]:
    started: dict[str, Backend] = {}
    try:
        for name in names:
            started[name] = Backend(name, free_port()).start()
        yield started
    finally:
        for backend in started.values():
            backend.stop()
