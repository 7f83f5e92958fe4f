"""Ray Serve's HAProxyManager, replayed: how Ray 2.60 starts, reloads, checks and stops the
binary it runs as HAProxy (ray/serve/_private/haproxy.py, HAProxyApi; /work/shared/ray-serve-facts.md).

Not a fake of HAProxy or of the bridge: it runs a real executable (the bridge, or HAProxy
itself for a control) exactly as Ray does, and waits the way Ray waits:
- start: `<bin> -db -f <cfg> -dR`; reload: `<bin> -db -f <cfg> -dR -sf <pid> <old pids> -x <admin.sock>`,
  each after rewriting the config in place (under a flock);
- ready: `show info` on the config's `stats socket` every 0.5 s until `Pid:` is the spawned PID,
  for at most 30 s, then SIGKILL and RuntimeError("HAProxy crashed during startup: <stderr tail>")
  when it exited;
- before a reload: `show servers state` saved to the server-state file; after: SIGUSR1 to every
  live old PID whose /proc cmdline names the config;
- stop: SIGKILL of the current and every old process.
Ray-shaped configs are rendered on 127.0.0.1 ports (Ray binds `*:8000`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rigs.harness import ROOT

STARTUP_TIMEOUT_S = 30.0


def bridge_executable(directory: Path) -> Path:
    """The bridge as an executable file, for RAY_SERVE_HAPROXY_BINARY_PATH: the console script
    `haproxy-supervisor-ray-bridge` of this checkout (the tests' `supervisor` package)."""
    path = directory / "haproxy-supervisor-ray-bridge"
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from supervisor.ray_bridge import main\n"
        "sys.exit(main())\n"
    )
    path.chmod(0o755)
    return path


@dataclass
class App:
    name: str
    servers: list[str] = field(default_factory=list)  # host:port of each replica
    prefix: str = ""

    @property
    def route(self) -> str:
        return self.prefix or f"/{self.name}"


@functools.cache
def has_prometheus_exporter(binary: str) -> bool:
    """Whether the binary was built with the Prometheus exporter Ray's template uses (`haproxy -vv`)."""
    out = subprocess.run([binary, "-vv"], capture_output=True, text=True, timeout=30).stdout
    return any(line.startswith("Available services") and "prometheus-exporter" in line for line in out.splitlines())


def ray_config(
    node_dir: Path, front: int, stats_port: int, metrics_port: int, apps: list[App], fallback: str | None,
    tag: str = "r1", hard_stop_after_s: int = 120, prometheus: bool = True,
) -> str:
    """A config shaped like Ray Serve 2.60's HAPROXY_CONFIG_TEMPLATE (optimised options on),
    bound on 127.0.0.1. `prometheus`: its exporter frontend (builds without the exporter refuse it)."""
    admin = node_dir / "admin.sock"
    lines = [
        "global",
        f"    stats socket {admin} mode 666 level admin expose-fd listeners",
        "    stats timeout 30s",
        "    maxconn 1000",
        "    nbthread 2",
        "    tune.bufsize 16384",
        f"    server-state-base {node_dir}",
        f"    server-state-file {node_dir / 'server_state'}",
        f"    hard-stop-after {hard_stop_after_s}s",
        "defaults",
        "    mode http",
        "    option log-health-checks",
        "    timeout connect 5s",
        "    timeout client 3600s",
        "    timeout server 60s",
        "    timeout http-keep-alive 55s",
        "    log global",
        "    option httplog",
        "    option abortonclose",
        "    option redispatch 1",
        "    retry-on conn-failure",
        "    option idle-close-on-response",
        "    load-server-state-from-file global",
        "    balance leastconn",
    ]
    if prometheus:
        lines += [
            "frontend prometheus",
            f"    bind 127.0.0.1:{metrics_port}",
            "    mode http",
            "    http-request use-service prometheus-exporter if { path /metrics }",
            "    no log",
        ]
    lines += [
        "frontend http_frontend",
        f"    bind 127.0.0.1:{front}",
        "    acl healthcheck path -i /-/healthz",
        "    http-request set-log-level debug if healthcheck",
    ]
    for app in apps:
        lines.append(f"    acl backend_{app.name}_server_up nbsrv({app.name}) ge 1")
    for app in apps:
        lines.append(
            f'    http-request return status 200 content-type text/plain string "success" '
            f"if healthcheck backend_{app.name}_server_up"
        )
    lines += [
        '    http-request return status 503 content-type text/plain string "Service Unavailable" if healthcheck',
        f"    http-response set-header x-ray-config {tag}",
    ]
    for app in apps:
        lines += [f"    acl is_{app.name} path_beg {app.route}/", f"    acl is_{app.name} path {app.route}"]
    for app in apps:
        lines.append(f"    use_backend {app.name} if is_{app.name}")
    lines += [
        "    default_backend default_backend",
        "backend default_backend",
        "    http-request return status 404 content-type text/plain string \"Path not found\"",
    ]
    for app in apps:
        lines += [
            f"backend {app.name}",
            "    log global",
            "    http-reuse always",
            "    option httpchk GET /",
            "    http-check expect status 200",
            "    default-server fastinter 250ms downinter 250ms fall 2 rise 2 inter 5s check",
        ]
        for i, address in enumerate(app.servers):
            lines.append(f"    server SERVE_REPLICA_{app.name}-{i} {address} check")
        if fallback is not None:
            lines.append(f"    server SERVE_FALLBACK {fallback} check backup")
    lines += [
        "listen stats",
        f"    bind 127.0.0.1:{stats_port}",
        "    stats enable",
        "    stats uri /stats",
    ]
    return "\n".join(lines) + "\n"


async def send_socket_command(path: Path, command: str, timeout: float = 5.0) -> str:
    """HAProxyApi._send_socket_command: one command, read until the socket closes."""
    if not path.exists():
        raise RuntimeError(f"HAProxy socket file does not exist: {path}.")
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout)
    try:
        writer.write(f"{command}\n".encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return data.decode("utf-8", errors="ignore")


def pid_of_show_info(answer: str) -> int | None:
    for line in answer.splitlines():
        if line.startswith("Pid:"):
            try:
                return int(line.split(":", 1)[1])
            except ValueError:
                return None
    return None


def _tail(path: Path, n: int = 4096) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="ignore").strip()
    except OSError:
        return ""


@dataclass
class Spawn:
    proc: asyncio.subprocess.Process
    args: list[str]
    stdout: Path
    stderr: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_text(self) -> str:
        return self.stderr.read_text(errors="replace") if self.stderr.exists() else ""


class RayManager:
    """One node's HAProxyManager: its config file, admin socket and the processes it spawned."""

    def __init__(
        self, node_dir: Path, binary: Path | str, env: dict[str, str] | None = None,
        optimized: bool = True, reuse_port: bool = False,
    ) -> None:
        self.node_dir = node_dir
        node_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = node_dir / "haproxy.cfg"
        self.socket_path = node_dir / "admin.sock"
        self.server_state_file = node_dir / "server_state"
        self.binary = str(binary)
        self.env = {**os.environ, **(env or {})}
        self.optimized = optimized  # RAY_SERVE_ENABLE_HAPROXY_OPTIMIZED_CONFIG: -x and the state file
        self.reuse_port = reuse_port  # SERVE_SOCKET_REUSE_PORT_ENABLED: no -dR
        self.current: Spawn | None = None
        self.old: list[Spawn] = []
        self.spawned: list[Spawn] = []
        self._seq = 0

    # ------------------------------------------------------------ the config file

    def write_config(self, text: str) -> None:
        """_generate_config_file_internal: rewritten in place under a flock, never renamed."""
        with (self.node_dir / "haproxy.cfg.lock").open("w") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                with self.config_path.open("w") as f:
                    f.write(text)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    # ------------------------------------------------------------ processes

    async def spawn(self, *extra: str) -> Spawn:
        """Run the binary as Ray does, without waiting for it (a test that kills it meanwhile)."""
        args = [self.binary, "-db", "-f", str(self.config_path)]
        if not self.reuse_port:
            args.append("-dR")
        args.extend(extra)
        self._seq += 1
        base = self.node_dir / f"admin.sock.{os.getpid()}.{self._seq}"
        stdout, stderr = Path(f"{base}.stdout.log"), Path(f"{base}.stderr.log")
        with stdout.open("wb", buffering=0) as out, stderr.open("wb", buffering=0) as err:
            proc = await asyncio.create_subprocess_exec(*args, stdout=out, stderr=err, env=self.env)
        spawn = Spawn(proc, args, stdout, stderr)
        self.spawned.append(spawn)
        return spawn

    async def running_pid(self) -> int | None:
        try:
            return pid_of_show_info(await send_socket_command(self.socket_path, "show info"))
        except (OSError, RuntimeError, TimeoutError):
            return None

    async def wait_available(self, spawn: Spawn, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """_wait_for_hap_availability."""
        started = time.time()
        while time.time() - started < timeout_s:
            if spawn.proc.returncode is not None:
                output = _tail(spawn.stderr) or _tail(spawn.stdout)
                raise RuntimeError(f"HAProxy crashed during startup: {output or f'exit code {spawn.proc.returncode}'}")
            if await self.running_pid() == spawn.pid:
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"HAProxy (pid={spawn.pid}) did not take over the admin socket within {timeout_s} seconds.")

    async def _start_and_wait(self, *extra: str) -> Spawn:
        spawn = await self.spawn(*extra)
        try:
            await self.wait_available(spawn)
        except Exception:
            if spawn.proc.returncode is None:
                spawn.proc.kill()
                await spawn.proc.wait()
            raise
        return spawn

    async def start(self, text: str) -> Spawn:
        self.write_config(text)
        self.current = await self._start_and_wait()
        return self.current

    def is_ours(self, pid: int) -> bool:
        """_is_our_haproxy: /proc/<pid>/cmdline names our config file."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return str(self.config_path).encode() in f.read().split(b"\0")
        except OSError:
            return False

    def prune(self) -> None:
        self.old = [s for s in self.old if s.proc.returncode is None]

    async def reload(self, text: str) -> Spawn:
        """HAProxyApi.reload: rewrite the config, then _graceful_reload."""
        self.write_config(text)
        old = self.current
        assert old is not None
        await self.wait_available(old)
        if self.optimized:
            state = await send_socket_command(self.socket_path, "show servers state")
            self.server_state_file.write_text(state)
        self.prune()
        live_old = [str(s.pid) for s in self.old if self.is_ours(s.pid)]
        extra = ["-sf", str(old.pid), *live_old]
        if self.optimized:
            extra += ["-x", str(self.socket_path)]
        self.current = await self._start_and_wait(*extra)
        self.old.append(old)
        self.soft_stop_old()
        return self.current

    def soft_stop_old(self) -> None:
        self.prune()
        for spawn in self.old:
            if self.is_ours(spawn.pid):
                with contextlib.suppress(OSError):
                    os.kill(spawn.pid, signal.SIGUSR1)

    def has_alive_old_procs(self) -> bool:
        self.prune()
        return bool(self.old)

    def count_processes(self) -> int:
        """count_haproxy_processes: what `serve_haproxy_process_count` shows."""
        return sum(1 for entry in os.listdir("/proc") if entry.isdigit() and self.is_ours(int(entry)))

    async def stop(self) -> None:
        """HAProxyApi.stop: SIGKILL the current and every old process."""
        for spawn in [s for s in [self.current, *self.old] if s is not None]:
            if spawn.proc.returncode is None:
                spawn.proc.kill()
                await spawn.proc.wait()
        self.current = None
        self.old = []

    async def cleanup(self) -> None:
        """Every process this manager spawned is gone, by PID (a test's last step)."""
        for spawn in self.spawned:
            if spawn.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    spawn.proc.kill()
                await spawn.proc.wait()
