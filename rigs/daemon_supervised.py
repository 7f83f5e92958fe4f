"""The daemon as a "Supervised": the real daemon (rigs/daemon.py) behind the interface of
rigs/supervised.Supervised, its State read back from /status and /metrics."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rigs.daemon import Daemon

# ---------------------------------------------------------------- the daemon as a "Supervised"


class StatusSnapshot:
    """The parts of State that end-to-end checks read, rebuilt from the daemon's /status and
    /metrics, so a check written against the in-process component reads the real daemon."""

    def __init__(self, doc: dict, metrics: str) -> None:
        from types import SimpleNamespace

        self.doc = doc
        self.dead_servers = set(doc["dead_servers"])
        self.old_workers = {
            w["pid"]: SimpleNamespace(
                push=SimpleNamespace(**w["push"]), steered=w["steered"], started_at=w["age_s"],
                generation=w["generation"],
            )
            for w in doc["old_workers"]
        }
        values = _metric_values(metrics)
        self.push_failures = int(values.get("haproxy_supervisor_push_failures_total", 0))
        self.push_duration = SimpleNamespace(count=int(values.get("haproxy_supervisor_push_duration_seconds_count", 0)))


def _metric_values(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


class DaemonSupervised:
    """The real daemon behind the interface of rigs/supervised.Supervised."""

    def __init__(self, daemon: Daemon) -> None:
        from rigs.harness import HAProxyMaster

        self.daemon = daemon
        # Only its master-CLI helpers are used (command, worker_pids): the daemon owns HAProxy.
        self.master = HAProxyMaster(daemon.runtime / "haproxy.cfg", daemon.runtime)
        self.generation = 1
        self.state: StatusSnapshot | None = None

    @property
    def current_pid(self) -> int:
        pid, _ = self.master.worker_pids()
        assert pid is not None
        return pid

    async def reload(self, rendered: str) -> int:
        self.generation += 1
        self.daemon.write(rendered)
        return await self.daemon.wait_generation(self.generation)

    async def request(self, path: str) -> tuple[int, str]:
        import aiohttp

        connector = aiohttp.UnixConnector(path=str(self.daemon.directory / "status.sock"))
        async with aiohttp.ClientSession(connector=connector) as session, session.get(f"http://daemon{path}") as r:
            return r.status, await r.text()

    async def refresh_state(self) -> StatusSnapshot:
        import json

        _, doc = await self.request("/status")
        _, metrics = await self.request("/metrics")
        self.state = StatusSnapshot(json.loads(doc), metrics)
        return self.state

    async def wait_steered(self, pids: list[int], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            state = await self.refresh_state()
            workers = [state.old_workers.get(pid) for pid in pids]
            if all(w is not None and w.push.state == "ok" and w.steered for w in workers):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"old workers not steered: {state.doc['old_workers']}")
            await asyncio.sleep(0.05)
