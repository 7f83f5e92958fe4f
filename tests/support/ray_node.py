"""A Ray node for the bridge's end-to-end tests: the daemon (started with no config: Ray renders
it), replica backends r1 and r2, the fallback proxy fb, and HAProxyManagers that run the bridge."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from rigs.daemon import Daemon, RunAs, http_get
from rigs.harness import Backend, backends, free_port, haproxy_binary
from rigs.ray_driver import App, RayManager, bridge_executable, has_prometheus_exporter, ray_config
from supervisor.statusclient import fetch_status, url_from_listen

SETTINGS = {
    "haproxy": {"move_stats_socket": True},
    "reload": {"runtime_apply": True, "debounce_ms": 50},
    "old_workers": {"guard": True, "hand_off": True},  # as docs/ray-serve.md sets them
}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class RayNode:
    directory: Path
    daemon: Daemon
    bridge: Path
    backends: dict[str, Backend]
    front: int
    stats: int
    metrics: int
    managers: list[RayManager]

    def manager(self, binary: Path | str | None = None) -> RayManager:
        """A (new) HAProxyManager for this node, as a restarted actor would be."""
        made = RayManager(
            self.directory / "haproxy-serve", binary or self.bridge,
            env={"HAPROXY_SUPERVISOR_SETTINGS": str(self.daemon.settings_path)},
        )
        self.managers.append(made)
        return made

    def config(self, *replicas: str, tag: str = "r1", fallback: bool = True, hard_stop_after_s: int = 60) -> str:
        """Ray's config for one app `a` served by the named backends (none: its first render)."""
        apps = [App("a", [self.backends[name].address for name in replicas])]
        return ray_config(
            self.directory / "haproxy-serve", self.front, self.stats, self.metrics, apps,
            self.backends["fb"].address if fallback else None, tag=tag, hard_stop_after_s=hard_stop_after_s,
            prometheus=has_prometheus_exporter(haproxy_binary()),
        )

    async def status(self) -> dict:
        listen = yaml.safe_load(self.daemon.settings_path.read_text())["status"]["listen"]
        return await fetch_status(url_from_listen(listen))

    async def get(self) -> tuple[int, str, str]:
        """(status, the backend that answered, the config tag) of one request to app `a`."""
        status, headers, body = await http_get(self.front, "/a")
        return status, body, headers.get("x-ray-config", "")

    @property
    def worker_socket(self) -> Path:
        return self.daemon.runtime / "stats.sock"


@contextlib.asynccontextmanager
async def ray_node(
    directory: Path, settings: dict | None = None, run_as: RunAs | None = None
) -> AsyncIterator[RayNode]:
    """A daemon for a Ray node (run as `run_as`, if given), started with no config yet (Ray
    renders it), and backends r1, r2 (replicas) and fb (the fallback proxy)."""
    with backends("r1", "r2", "fb") as started:
        extra = settings or {}
        merged = {key: {**SETTINGS.get(key, {}), **extra.get(key, {})} for key in {*SETTINGS, *extra}}
        daemon = Daemon(directory / "d", "", merged)
        daemon.rendered.unlink()
        node = RayNode(directory, daemon, bridge_executable(directory), started, free_port(), free_port(),
                       free_port(), [])
        try:
            daemon.start(run_as=run_as)
            await daemon.wait_log("status: listening")
            yield node
        finally:
            for manager in node.managers:
                await manager.cleanup()
            daemon.cleanup()


async def wait_until(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


