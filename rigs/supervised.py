"""HAProxy under the daemon's own parts, run in the test's process so that a test reaches
the steering they drive: the MasterProcess, the Reloader with OldWorkers as its hooks, and
HAProxy's stderr relay feeding OldWorkers its server events, wired as supervisor/daemon.py
wires them. `reload()` writes the rendered config and asks the Reloader for a forced reload
(the road of SIGHUP): the product's cycle builds, checks, steers, reloads, confirms and
records it. HAProxy's own lines go to <runtime_dir>/haproxy.log.

Left out of the daemon's wiring, so that every `reload()` makes a new worker that starts from
its config: the runtime apply and the server-state hand-over (RuntimeApplier), and the
stalled-connection detector. rigs/daemon.py runs the daemon itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from rigs.daemon import write_atomic
from rigs.harness import HAProxyMaster, haproxy_binary
from supervisor.effective import prepare_runtime_dir
from supervisor.haproxy.api import MasterCLI
from supervisor.haproxy.stderr import StderrRelay
from supervisor.master.process import MasterProcess
from supervisor.reloader import Reloader
from supervisor.settings import HAProxySettings, Settings
from supervisor.state import ReloadRecord, State
from supervisor.steering.mapdiff import map_entries
from supervisor.steering.workers import OldWorkers


def rig_settings(settings: Settings) -> Settings:
    """The caller's settings, with what the rig needs: a rendered config of its own beside the
    runtime files, the suite's HAProxy, reloads as soon as asked, and a short stop."""
    h = settings.haproxy
    binary = haproxy_binary() if h.binary == HAProxySettings.binary else h.binary
    rendered = h.runtime_dir / "rendered" / "haproxy.cfg"
    return replace(
        settings,
        haproxy=replace(h, binary=binary, config=rendered, stop_timeout_s=min(h.stop_timeout_s, 2)),
        reload=replace(settings.reload, min_interval_ms=0),
    )


@dataclass
class DaemonParts:
    """One daemon's life of them: a restart builds them again."""

    master: MasterProcess
    reloader: Reloader
    displaced: OldWorkers
    relay: StderrRelay

    @classmethod
    def wired(
        cls,
        settings: Settings,
        state: State,
        steering_cli: MasterCLI,
        log_fd: int,
        reconcile_interval_s: float | None = None,
    ) -> DaemonParts:
        """Built and wired, the relay open; nothing runs yet."""
        # The master and the reloader have a master CLI of their own, so that one a test swaps
        # in for the steering (counting what it asks) counts the steering's questions only.
        cli = MasterCLI(settings.haproxy.master_socket_path)
        relay = StderrRelay(settings.haproxy.stderr_fifo, forward_fd=log_fd)
        relay.open()
        master = MasterProcess(settings, state, cli, stderr=relay)
        displaced = OldWorkers(settings, state, steering_cli)
        if reconcile_interval_s is not None:
            displaced.rounds.RECONCILE_INTERVAL_S = reconcile_interval_s
        relay.subscribe(displaced.on_server_event)
        reloader = Reloader(settings, state, cli, master, displaced)
        master.on_started = reloader.on_master_started
        return cls(master, reloader, displaced, relay)


@dataclass
class Supervised:
    settings: Settings
    state: State
    master: HAProxyMaster  # its blocking master-CLI helpers only: `parts.master` owns HAProxy
    cli: MasterCLI  # the steering's
    parts: DaemonParts
    log_fd: int  # HAProxy's lines, forwarded by the relay
    task: asyncio.Task | None = None  # the steering's
    daemon_tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def displaced(self) -> OldWorkers:
        return self.parts.displaced

    @property
    def reloader(self) -> Reloader:
        return self.parts.reloader

    def start_displaced(self) -> None:
        self.task = asyncio.create_task(self.displaced.run())

    async def stop_displaced(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    def start_daemon(self) -> None:
        self.daemon_tasks = [asyncio.create_task(self.parts.master.run()), asyncio.create_task(self.reloader.run())]
        self.start_displaced()

    async def stop_daemon(self) -> None:
        """Every task stopped, HAProxy left running, as SIGQUIT leaves it. A task that had
        crashed raises here: it would have crashed the daemon."""
        await self.stop_displaced()
        for task in self.daemon_tasks:
            task.cancel()
        ended = await asyncio.gather(*self.daemon_tasks, return_exceptions=True)
        self.daemon_tasks = []
        self.parts.relay.close()  # HAProxy's lines are lost until the next relay opens the FIFO
        for outcome in ended:
            if isinstance(outcome, Exception):  # not a CancelledError, a BaseException
                raise outcome

    async def reload_now(self, reason: str) -> ReloadRecord | None:
        """The Reloader's answer to a forced reload; a daemon task that ends first raises."""
        asked = asyncio.ensure_future(self.reloader.reload_now(reason=reason))
        await asyncio.wait({asked, *self.daemon_tasks}, return_when=asyncio.FIRST_COMPLETED)
        if not asked.done():
            asked.cancel()
            await self.stop_daemon()
            raise RuntimeError("a daemon task ended")
        return asked.result()

    async def restart(self, reconcile_interval_s: float | None = None) -> None:
        """A daemon restart: HAProxy goes on running; a new State, master, reloader and steering
        adopt the master, recover the generations from runtime_dir, and the steering must learn
        the old workers' maps from HAProxy."""
        await self.stop_daemon()
        self.state = State(haproxy_binary=self.settings.haproxy.binary)
        self.parts = DaemonParts.wired(self.settings, self.state, self.cli, self.log_fd, reconcile_interval_s)
        adopted = await self.parts.master.adopt()
        assert adopted is not None, "no master to adopt"
        self.reloader.rebuild(adopted)
        self.start_daemon()

    async def map_of(self, pid: int) -> dict[str, str]:
        return map_entries(await self.cli.on(pid, f"show map {self.settings.haproxy.steer_map}"))

    @property
    def current_pid(self) -> int:
        current = self.state.current
        assert current is not None and current.worker_pid is not None
        return current.worker_pid

    async def reload(self, rendered: str) -> int:
        """`rendered` written and reloaded by the Reloader's cycle; returns the new worker's PID."""
        write_atomic(self.settings.haproxy.config, rendered)
        record = await self.reload_now("rigs.supervised")
        check_record(record, "reload")
        return self.current_pid

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


def check_record(record: ReloadRecord | None, what: str, ok: tuple[str | None, ...] = ("ok",)) -> None:
    """Raise unless the cycle's record is one of `ok`: ValueError for a config `haproxy -c`
    refused, RuntimeError for any other outcome."""
    result = record.result if record else None
    if result in ok:
        return
    error = record.error if record else None
    if result == "invalid":
        raise ValueError(f"{what}: haproxy -c refused the config: {error}")
    raise RuntimeError(f"{what}: {result}: {error}")


@contextlib.asynccontextmanager
async def supervised(settings: Settings, rendered: str) -> AsyncIterator[Supervised]:
    """Start HAProxy on `rendered` (plus injections) the way the daemon does, its steering beside it."""
    settings = rig_settings(settings)
    prepare_runtime_dir(settings)
    settings.haproxy.config.parent.mkdir(exist_ok=True)
    write_atomic(settings.haproxy.config, rendered)
    state = State(haproxy_binary=settings.haproxy.binary)
    cli = MasterCLI(settings.haproxy.master_socket_path)
    helpers = HAProxyMaster(settings.haproxy.effective_config, Path(settings.haproxy.runtime_dir))
    log_fd = os.open(settings.haproxy.runtime_dir / "haproxy.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        sup = Supervised(settings, state, helpers, cli, DaemonParts.wired(settings, state, cli, log_fd), log_fd)
        sup.start_daemon()
        try:
            # The daemon's first cycle: checked and written, the master is started on it, and
            # its first worker recorded as generation 1 (no record: none went wrong).
            check_record(await sup.reload_now("startup"), "startup", ok=(None,))
            await sup.until(
                lambda: sup.state.current is not None, timeout=settings.reload.timeout_s, what="the first worker"
            )
            yield sup
        finally:
            try:
                await sup.parts.master.stop()
            finally:
                await sup.stop_daemon()
    finally:
        os.close(log_fd)
