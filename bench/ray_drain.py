"""The drain incident with real Ray Serve 2.60: a two-node cluster loses its second node.

Three ways in one run, each on a fresh cluster in namespaces of its own (network, PID, mount):
    stock Ray, observe off    Ray as it ships but RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED=0
    stock Ray as it ships     observe layer4 error-limit 3 on-error mark-down on every server
    Ray with the bridge       a daemon per node, Ray pointed at haproxy-supervisor-ray-bridge

The cluster is `ray.cluster_utils.Cluster` on one machine: the head, and a second raylet with
its own HAProxy ports (RAY_SERVE_WORKER_PROXY_HTTP_PORT, and RAY_SERVE_HAPROXY_STATS_PORT /
_METRICS_PORT in its environment). Apps `wide` and `moved` have one replica on each node
(max_replicas_per_node=1); `lost` has its only replica on the second node and is left out of the
requests, since nothing can serve it. Clients open keep-alive connections to the head's HAProxy,
`moved` is redeployed (new replicas, so Ray renders anew), and then the second node vanishes:
nftables drops every TCP port its processes hold, both directions, and its raylet's tree is
killed with SIGKILL (with the bridge, its daemon too). Then R requests go out on the connections
held since before the redeploy, one every SPACING ms, the apps in turn. A connection the server
closed before answering is opened again, as an HTTP client would, inside the request's time.

Per way: requests that failed, slower than 0.5 s, the slowest, the median, all together, and
that as a multiple of the bridge's (bench/drain.py's table).

    python -m bench ray_drain
    python -m bench.ray_drain --requests 30 --spacing-ms 500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.drain import SLOW_S, Answer, Result, table
from tests.support.harness import short_tmpdir
from tests.support.ray_load import KeptConnection
from tests.support.ray_serve import (
    HTTP_PORT,
    NodeDaemon,
    deploy_apps,
    live_servers,
    loopback_up,
    ray_environment,
    ray_haproxy_binary,
    run_scenario,
    wait_until,
)

APPS = ("wide", "moved")  # `lost` is deployed but not asked: its only replica vanishes
SECOND_NODE_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": "8405", "RAY_SERVE_HAPROXY_METRICS_PORT": "9102"}
SECOND_NODE_HTTP_PORT = 8001
CONNECT_TIMEOUT_S = 5  # Ray's `timeout connect`
RETRIES = 3  # HAProxy's default: Ray's template sets none


@dataclass(frozen=True)
class RayMode:
    key: str
    name: str
    observe: bool
    bridge: bool


MODES = (
    RayMode("observe-off", "stock Ray, observe off", False, False),
    RayMode("stock", "stock Ray as it ships (observe on)", True, False),
    RayMode("bridge", "Ray with the bridge", True, True),
)


def application(name: str, tag: str, replicas: int, on_second_only: bool = False) -> dict[str, Any]:
    deployment: dict[str, Any] = {"name": "Echo", "num_replicas": replicas, "max_replicas_per_node": 1}
    if on_second_only:
        deployment["ray_actor_options"] = {"num_cpus": 0, "resources": {"second": 0.01}}
    return {"name": name, "route_prefix": f"/{name}", "import_path": "tests.support.ray_apps:one_deployment",
            "args": {"tag": tag}, "deployments": [deployment]}


def applications(moved_tag: str) -> list[dict[str, Any]]:
    return [application("wide", "v1", 2), application("moved", moved_tag, 2), application("lost", "v1", 1, True)]


# ------------------------------------------------------------------ the vanished node


def tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    return []


def held_ports(procs: list[psutil.Process]) -> set[int]:
    """Every local TCP port the processes hold: listeners and their ends of connections."""
    ports = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            ports.update(c.laddr.port for c in proc.net_connections(kind="tcp") if c.laddr)
    return ports


def drop_rules(ports: set[int]) -> str:
    """nftables rules under which packets to or from the ports vanish, both ways."""
    elements = ", ".join(str(p) for p in sorted(ports))
    chains = "".join(
        f"  chain {hook} {{ type filter hook {hook} priority 0; policy accept; "
        f"tcp dport @gone drop; tcp sport @gone drop; }}\n"
        for hook in ("output", "input")
    )
    return f"table inet vanished {{\n  set gone {{ type inet_service; elements = {{ {elements} }} }}\n{chains}}}\n"


def drop_ports(ports: set[int]) -> None:
    """Only inside the benchmark's own network namespace."""
    subprocess.run(["nft", "-f", "-"], input=drop_rules(ports).encode(), check=True)


def vanish(pids: list[int]) -> int:
    """The node leaves the network, then its processes die: returns how many ports dropped."""
    procs = [p for pid in pids for p in tree(pid)]
    ports = held_ports(procs) - {HTTP_PORT}
    drop_ports(ports)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
    return len(ports)


# ------------------------------------------------------------------ requests on held connections


class Held:
    """A keep-alive connection to the head's HAProxy for one app, opened before the redeploy."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.conn: KeptConnection | None = None

    async def open(self) -> None:
        self.conn = await KeptConnection.open(HTTP_PORT, 10)

    async def request(self, timeout: float) -> Answer:
        """One GET; a connection closed before any answer is opened again once, inside the time."""
        started = time.monotonic()
        status = 0
        for attempt in range(2):
            try:
                if self.conn is None:
                    await self.open()
                assert self.conn is not None
                status, _, close = await self.conn.get(f"/{self.app}", timeout - (time.monotonic() - started))
                if close:
                    self.close()
                break
            except (asyncio.IncompleteReadError, ConnectionError):
                self.close()
                if attempt == 1:
                    break
            except (TimeoutError, ValueError, OSError):
                break
        return Answer(self.app, status, time.monotonic() - started)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


async def staged(
    mode: RayMode, directory: Path, requests: int, spacing_ms: float, daemons: list[NodeDaemon],
) -> dict[str, Any]:
    """One way, on a fresh cluster; with the bridge, `daemons` are the head's and the second node's."""
    from ray import serve
    from ray.cluster_utils import Cluster

    env = ray_environment(directory, daemons[0].settings_path if daemons else None, draining_period_s=None)
    env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] = str(SECOND_NODE_HTTP_PORT)
    if not mode.observe:
        env["RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED"] = "0"
    os.environ.update(env)
    second_env = dict(SECOND_NODE_PORTS)
    if daemons:
        second_env["HAPROXY_SUPERVISOR_SETTINGS"] = str(daemons[1].settings_path)

    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "temp_dir": str(directory / "ray")})
    second = cluster.add_node(num_cpus=1, resources={"second": 1}, env_vars=second_env)
    serve.start(http_options={"host": "0.0.0.0", "port": HTTP_PORT})
    import ray

    head_sock = directory / "h" / ray.get_runtime_context().get_node_id() / "admin.sock"
    await asyncio.to_thread(deploy_apps, applications("v1"))
    routed = {app: wait_until(lambda a=app: len(s := live_servers(head_sock, f"http-{a}")) == 2 and s, 60,
                              f"{app} routed on both nodes") for app in APPS}

    per_app = -(-requests // len(APPS))
    held = [Held(app) for _ in range(per_app) for app in APPS][:requests]
    for conn in held:
        await conn.open()
        assert (await conn.request(10)).status == 200
    haproxy_before = [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"]

    await asyncio.to_thread(deploy_apps, applications("v2"), False)
    wait_until(lambda: len(s := live_servers(head_sock, "http-moved")) == 2 and not s & routed["moved"], 90,
               "moved's new replicas routed")
    haproxy_at_vanish = [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"]

    raylet = second.all_processes["raylet"][0].process.pid
    dropped = vanish([raylet, *([daemons[1].proc.pid] if daemons else [])])
    vanished_at = time.monotonic()

    timeout = (RETRIES + 1) * CONNECT_TIMEOUT_S + 5
    jobs = []
    for i, conn in enumerate(held):
        delay = vanished_at + i * spacing_ms / 1000 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        jobs.append(asyncio.create_task(conn.request(timeout)))
    answers = await asyncio.gather(*jobs)
    for conn in held:
        conn.close()
    notes = {
        "ports_dropped": dropped,
        "haproxy_processes_before_redeploy": len(haproxy_before),
        "haproxy_processes_at_vanish": len(haproxy_at_vanish),
    }
    if daemons:
        status = await asyncio.to_thread(daemons[0].status)
        reloads = status["reloads"] if status else {}
        notes["head_daemon_reloads"] = {k: v for k, v in reloads.items() if isinstance(v, int)}
        daemons[0].stop()
    return {"mode": mode.key, "answers": [a.__dict__ for a in answers], "notes": notes}


def inside(args: argparse.Namespace) -> None:
    loopback_up()
    mode = next(m for m in MODES if m.key == args.mode)
    daemons = []
    if mode.bridge:
        daemons = [NodeDaemon(args.dir / name, ray_haproxy_binary()).start() for name in ("head", "second")]
    result = asyncio.run(staged(mode, args.dir, args.requests, args.spacing_ms, daemons))
    args.out.write_text(json.dumps(result))
    # Ray's processes and the vanished node's half-open connections end with the namespace.
    sys.stdout.flush()
    os._exit(0)


def run(requests: int, spacing_ms: float) -> list[tuple[Result, dict[str, Any]]]:
    results = []
    for mode in MODES:
        directory = short_tmpdir("hs-rd-")
        try:
            found = run_scenario("bench.ray_drain", ["--inside", "--mode", mode.key, "--dir", str(directory),
                                                     "--requests", str(requests), "--spacing-ms", str(spacing_ms)],
                                 600, directory / "run.log")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        answers = [Answer(**a) for a in found["answers"]]
        results.append((Result(mode.name, answers), found["notes"]))
    return results


def by_app(result: Result) -> str:
    """Failed (and their statuses) and slow requests of each app."""
    parts = []
    for app in APPS:
        mine = [a for a in result.answers if a.app == app]
        statuses = sorted({a.status for a in mine if a.status != 200})
        failed = sum(a.status != 200 for a in mine)
        slow = sum(a.seconds > SLOW_S for a in mine)
        answered = f" {statuses}" if statuses else ""
        parts.append(f"{app} failed {failed}{answered} slow {slow}")
    return ", ".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.ray_drain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30,
                        help="requests on held connections after the node vanished (default %(default)s)")
    parser.add_argument("--spacing-ms", type=float, default=500.0,
                        help="time between two requests' departures (default %(default)s)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=[m.key for m in MODES], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests <= 0 or args.spacing_ms < 0:
        parser.error("--requests must be positive and --spacing-ms not negative")
    return args


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: one run of the three ways, 30 requests 500 ms apart (6, 200 ms when quick)."""
    results = run(6, 200.0) if quick else run(30, 500.0)
    for result, notes in results:
        print(f"  {result.mode}: {by_app(result)}; {json.dumps(notes)}", flush=True)
    return table([r for r, _ in results])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.inside:
        inside(args)
        return
    print(
        f"{args.requests} requests on keep-alive connections held since before a redeploy, after the second "
        f"of two Ray nodes vanished: Ray Serve 2.60, timeout connect {CONNECT_TIMEOUT_S}s, retries {RETRIES}, "
        f"option redispatch 1, one request every {args.spacing_ms:g} ms",
        flush=True,
    )
    results = run(args.requests, args.spacing_ms)
    for result, notes in results:
        print(f"  {result.mode}: {by_app(result)}; {json.dumps(notes)}", flush=True)
    print(table([r for r, _ in results]))


if __name__ == "__main__":
    main()
