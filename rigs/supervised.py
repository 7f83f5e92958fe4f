"""HAProxy under the displaced-worker component, with the daemon's part played by the test.

The reloader and daemon live elsewhere; this fixture does what architecture.md says
they do around a reload (build the effective config, `haproxy -c` with prepare while it
runs, before_reload, write, `reload` on the master CLI, confirm with `show proc`, register
the generation, after_reload) so the end-to-end tests exercise OldWorkers exactly
through its contract. rigs/daemon.py runs the real daemon instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from rigs.harness import HAProxyMaster
from supervisor.effective import build_effective, prepare_runtime_dir, start_effective_check, write_effective
from supervisor.haproxy.api import CLIError, MasterCLI
from supervisor.haproxy.config import Config
from supervisor.master.process import bind_ports, worker_ready
from supervisor.settings import Settings
from supervisor.state import Generation, State, utcnow
from supervisor.steering.mapdiff import map_entries
from supervisor.steering.workers import OldWorkers


@dataclass
class Supervised:
    settings: Settings
    state: State
    master: HAProxyMaster
    cli: MasterCLI
    displaced: OldWorkers
    task: asyncio.Task | None = None
    reload_seconds: list[float] = field(default_factory=list)

    def start_displaced(self) -> None:
        self.task = asyncio.create_task(self.displaced.run())

    async def stop_displaced(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def restart_displaced(self, reconcile_interval_s: float | None = None) -> None:
        """What a daemon restart leaves: the generations (recovered from runtime_dir), nothing
        else; a new OldWorkers that must learn the old workers' maps from HAProxy."""
        await self.stop_displaced()
        self.state = State(
            generations=self.state.generations,
            current_generation=self.state.current_generation,
            last_good_sha256=self.state.last_good_sha256,
            master_up=True,
        )
        self.displaced = OldWorkers(self.settings, self.state, self.cli, reconcile_interval_s)
        self.start_displaced()

    async def map_of(self, pid: int) -> dict[str, str]:
        return map_entries(await self.cli.on(pid, f"show map {self.settings.haproxy.steer_map}"))

    @property
    def current_pid(self) -> int:
        current = self.state.current
        assert current is not None and current.worker_pid is not None
        return current.worker_pid

    def register(self, model: Config, rendered_sha: str, effective_sha: str, pid: int) -> Generation:
        number = (self.state.current_generation or 0) + 1
        generation = Generation(number, model, effective_sha, rendered_sha, utcnow(), pid)
        self.state.generations[number] = generation
        self.state.current_generation = number
        self.state.last_good_sha256 = effective_sha
        return generation

    async def reload(self, rendered: str, confirm_timeout: float = 15.0) -> int:
        """The reload sequence of architecture.md; returns the new worker's PID."""
        effective = build_effective(self.settings, rendered)
        next_model = Config.parse(effective.text)
        before = self.current_pid
        check = await start_effective_check(self.settings.haproxy.binary, effective, self.settings.haproxy.runtime_dir)
        plan = None
        try:
            plan = await self.displaced.prepare(effective)
        finally:
            valid, message = await check.verdict()
        if not valid:
            raise ValueError(f"haproxy -c refused the config: {message}")
        plan = await self.displaced.before_reload(plan)
        write_effective(self.settings.haproxy.effective_config, effective)
        started = time.monotonic()
        with contextlib.suppress(CLIError):  # 2.6 may drop the connection as the master re-executes
            await self.cli.reload()
        deadline = time.monotonic() + confirm_timeout
        ports = bind_ports(next_model)
        new_pid = None
        while new_pid is None:
            if time.monotonic() > deadline:
                await self.displaced.after_reload(plan, False)
                raise TimeoutError("no new worker after reload")
            with contextlib.suppress(CLIError):
                procs = await self.cli.show_proc()
                current = procs.current_worker
                # Ready, not only listed: from 3.1 on the master lists the new worker before it has
                # loaded its config, while the reload is still under way.
                if current is not None and current.pid != before and await worker_ready(self.cli, current.pid, ports):
                    new_pid = current.pid
            if new_pid is None:
                await asyncio.sleep(0.01)
        self.reload_seconds.append(time.monotonic() - started)
        # The same effective config before_reload saw: its digest is found by its sha256.
        self.register(next_model, effective.rendered_sha256, effective.sha256, new_pid)
        await self.displaced.after_reload(plan, True)
        return new_pid

    async def refresh_state(self) -> State:
        """The state checks read (the daemon-backed twin fetches it over HTTP)."""
        return self.state

    async def until(self, predicate, timeout: float = 10.0, what: str = "condition"):
        """Poll `predicate` (sync or async) without blocking the event loop."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            await asyncio.sleep(0.02)

    async def wait_steered(self, pids: list[int], timeout: float = 10.0) -> None:
        """Until every given old worker's map was pushed and read back equal."""
        deadline = time.monotonic() + timeout
        while True:
            workers = [self.state.old_workers.get(pid) for pid in pids]
            if all(w is not None and w.push.state == "ok" for w in workers):
                return
            if time.monotonic() > deadline:
                pushes = [(pid, w and w.push) for pid, w in zip(pids, workers, strict=True)]
                raise TimeoutError(f"old workers not steered: {pushes}")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def supervised(settings: Settings, rendered: str) -> AsyncIterator[Supervised]:
    """Start HAProxy on `rendered` (plus injections) and run OldWorkers beside it."""
    prepare_runtime_dir(settings)
    effective = build_effective(settings, rendered)
    write_effective(settings.haproxy.effective_config, effective)
    runtime = settings.haproxy.runtime_dir
    master = HAProxyMaster(settings.haproxy.effective_config, Path(runtime)).start()
    try:
        cli = MasterCLI(master.socket)
        state = State()
        displaced = OldWorkers(settings, state, cli)
        sup = Supervised(settings, state, master, cli, displaced)
        pid, _ = master.worker_pids()
        assert pid is not None
        state.master_pid = master.proc.pid if master.proc else None
        state.master_up = True
        sup.register(Config.parse(effective.text), effective.rendered_sha256, effective.sha256, pid)
        sup.start_displaced()
        try:
            yield sup
        finally:
            await sup.stop_displaced()
    finally:
        master.stop()
