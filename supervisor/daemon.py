"""`haproxy-supervisor run`: wire the components, handle signals, talk to systemd. SIGTERM/SIGINT:
stop HAProxy gracefully, exit 0; SIGHUP: reload now; SIGQUIT: exit 3 and leave HAProxy running for
the next `run` to adopt (to upgrade the daemon alone); a crash also leaves it running, exit 1."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
from typing import Any

from .controller import ControllerSockets
from .controller.connections import stats_socket_capacity
from .effective import prepare_runtime_dir, remove_stale_checks
from .eventloop import LoopLag
from .files import RuntimeDirInUse, RuntimeDirLock, ensure_private_dir
from .haproxy.answers import ProcList, ServerKey
from .haproxy.api import MasterCLI
from .haproxy.runtime.hook import RuntimeApplier
from .haproxy.stderr import StderrRelay
from .logs import setup_logging
from .master.process import MasterError, MasterProcess, MasterSocketGone
from .notify import Notifier, summary_line
from .reloader import Reloader
from .settings import Settings
from .state import ReloadRecord, State
from .status.listener import StatusServer, StatusServerError
from .steering.detector import StalledDetector
from .steering.workers import OldWorkers

log = logging.getLogger(__name__)

EXIT_OK, EXIT_CRASHED, EXIT_REFUSED, EXIT_DETACHED = 0, 1, 2, 3


class DaemonActions:
    """What the status server may ask the daemon to do (`build_app(state, settings, actions)`)."""

    def __init__(self, reloader: Reloader, displaced: OldWorkers) -> None:
        self.reloader, self.displaced = reloader, displaced

    async def reload_now(self) -> ReloadRecord | None:
        return await self.reloader.reload_now(reason="POST /reload")

    async def mark_dead(self, backend: str, server: str) -> None:
        # Recorded at once; the displaced-worker loop wakes and pushes.
        self.displaced.mark_dead(ServerKey.checked(backend, server))

    async def unmark_dead(self, backend: str, server: str) -> None:
        self.displaced.unmark_dead(ServerKey.checked(backend, server))

    def has_server(self, backend: str, server: str) -> bool:
        """In the current config or in the config an old worker still runs."""
        return self.displaced.has_server(ServerKey.of(backend, server))


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = State(haproxy_binary=settings.haproxy.binary)
        self.notifier = Notifier()
        self.cli = MasterCLI(settings.haproxy.master_socket_path)
        self.master: MasterProcess | None = None
        self.reloader: Reloader | None = None
        self.displaced: OldWorkers | None = None  # the old workers' steering, once run() built it
        self._stop = asyncio.Event()
        self._reloader_built = asyncio.Event()
        self._detach = False
        self._signal_tasks: set[asyncio.Task[Any]] = set()
        self.runtime_lock = RuntimeDirLock(settings.haproxy.runtime_dir)

    def handle_stop(self, name: str) -> None:
        if self._stop.is_set():
            log.info("%s: already stopping", name)
            return
        log.info("%s: stopping haproxy gracefully, then exiting", name)
        self._stop.set()

    def handle_detach(self) -> None:
        log.info("SIGQUIT: exiting and leaving haproxy running for the next start to adopt")
        self._detach = True
        self._stop.set()

    def handle_reload(self) -> None:
        log.info("SIGHUP: reload requested")
        if self.reloader is None or self._stop.is_set():
            return
        # Coalesced with every other forced reload due (reload.min_interval_ms).
        task = asyncio.get_running_loop().create_task(self.reloader.reload_now(reason="SIGHUP"))
        self._signal_tasks.add(task)
        task.add_done_callback(self._signal_tasks.discard)

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.handle_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.handle_stop, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self.handle_reload)
        loop.add_signal_handler(signal.SIGQUIT, self.handle_detach)

    async def handle_master_started(self, procs: ProcList) -> None:
        assert self.reloader is not None
        await self.reloader.on_master_started(procs)
        self.notifier.ready(summary_line(self.state, len(procs.old_workers)))

    async def _controller_reload(self) -> ReloadRecord | None:
        await self._reloader_built.wait()  # the controller's sockets answer before it exists
        assert self.reloader is not None
        # The controller wrote its config, then asks: the change is applied as any change is.
        return await self.reloader.reload_now(reason="controller master socket", force=False)

    def _stats_socket_capacity(self) -> int:
        """How many connections the running config's stats socket accepts, for the relay."""
        current = self.state.current
        return stats_socket_capacity(current.model if current else None, self.settings.haproxy.stats_socket)

    async def run(self) -> int:
        try:
            return await self._run()
        finally:
            self.runtime_lock.release()

    async def _run(self) -> int:
        settings = self.settings
        try:
            ensure_private_dir(settings.haproxy.runtime_dir)
            # Before anything else in runtime_dir is read, written or removed, for our whole life.
            self.runtime_lock.acquire()
            prepare_runtime_dir(settings)
            for stale in remove_stale_checks(settings.haproxy.runtime_dir):
                log.info("removed %s: left by a daemon killed during `haproxy -c`", stale)
        except RuntimeDirInUse as exc:
            log.error("%s", exc.strerror)
            return EXIT_REFUSED
        except OSError as exc:
            log.error("%s: cannot prepare runtime_dir: %s", settings.haproxy.runtime_dir, exc.strerror or exc)
            return EXIT_CRASHED
        # Bound first (once runtime_dir is ours): a controller that finds its sockets silent
        # falls back to running HAProxy itself.
        controller = ControllerSockets(settings, self._controller_reload, lambda: self.displaced,
                                       self._stats_socket_capacity)
        try:
            await controller.start()
        except OSError as exc:
            log.error("controller sockets: %s", exc.strerror or exc)
            await controller.close()
            return EXIT_CRASHED
        self.state.publish_haproxy_version(await haproxy_version(settings.haproxy.binary))
        relay: StderrRelay | None = StderrRelay(settings.haproxy.stderr_fifo)
        try:
            relay.open()
        except OSError as exc:
            log.warning("%s: %s: haproxy writes to our stderr, server states are polled",
                        settings.haproxy.stderr_fifo, exc.strerror or exc)
            relay = None
        self.master = MasterProcess(settings, self.state, self.cli, on_started=self.handle_master_started, stderr=relay)
        displaced = self.displaced = OldWorkers(settings, self.state, self.cli)
        if relay is not None:
            relay.subscribe(displaced.on_server_event)
        # One applier serves both: it remembers the servers whose runtime change was refused,
        # so the state saved before the next reload leaves them out.
        state = self.state
        applier = RuntimeApplier(
            self.cli, remove_wait_s=settings.reload.remove_wait_s, background=settings.reload.remove_in_background,
            publish_removals=state.publish_pending_removals,
            current_pid=lambda: state.current.worker_pid if state.current is not None else None,
        )
        self.reloader = Reloader(
            settings, self.state, self.cli, self.master, displaced, self.notifier,
            runtime_apply=applier if settings.reload.runtime_apply else None,
            save_server_state=applier.save_server_state if settings.reload.preserve_server_state else None,
        )
        self._reloader_built.set()
        self.reloader.runtime_lock = self.runtime_lock
        # Bound before anything says READY=1: a daemon that cannot report must not start.
        status = StatusServer(settings, self.state, DaemonActions(self.reloader, displaced))
        try:
            await status.start()
        except StatusServerError as exc:
            log.error("%s: not starting without the status API", exc)
            if relay is not None:
                relay.close()
            await controller.close()
            return EXIT_REFUSED
        self._install_signals()
        log.info(
            "haproxy-supervisor starting pid=%d haproxy=%s binary=%s runtime_dir=%s",
            self.state.supervisor_pid, self.state.haproxy_version, settings.haproxy.binary,
            settings.haproxy.runtime_dir,
        )
        try:
            try:
                adopted = await self.master.adopt()
            except MasterSocketGone as gone:
                adopted = await self.reloader.recovery.take_back(gone.pid)
        except MasterError as exc:
            log.error("%s", exc)
            if relay is not None:
                relay.close()
            await status.stop()
            await controller.close()
            return EXIT_CRASHED
        if adopted is not None:
            await applier.resume_pending(self.reloader.rebuild(adopted))
            self.notifier.ready(summary_line(self.state, len(adopted.old_workers)))

        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(self.master.run(), name="master"),
                group.create_task(self.reloader.run(), name="reloader"),
                group.create_task(
                    self.notifier.run_watchdog(lambda: self.state.status_listener_down), name="watchdog"
                ),
                group.create_task(LoopLag(self.state).run(), name="event loop lag"),
                group.create_task(applier.pending.run(), name="pending removals"),
                group.create_task(displaced.run(), name="displaced"),
                group.create_task(StalledDetector(settings.detector, self.state, self.cli, displaced.wake).run(),
                                  name="stalled-connection detector"),
                group.create_task(status.run(), name="status"),
            ]
            if controller.enabled:
                tasks.append(group.create_task(controller.run(), name="controller sockets"))
            if adopted is None:
                tasks.append(group.create_task(self.reloader.reload_now(reason="startup")))

            await self._stop.wait()
            self.notifier.stopping()
            if self._detach:
                # Let an in-flight reload finish, so the next daemon finds generations.json current.
                self.master.stopping = True
                await self.master.lock.acquire()
            else:
                await self.master.stop()
            for task in (*tasks, *self._signal_tasks):
                task.cancel()
        if relay is not None:
            relay.close()  # HAProxy's lines from now on are lost (EPIPE) until the next daemon opens it
        if self._detach:
            log.info("haproxy-supervisor detached: haproxy master pid=%s left running, exit %d",
                     self.master.pid, EXIT_DETACHED)
            return EXIT_DETACHED
        log.info("haproxy-supervisor stopped: exit 0")
        return EXIT_OK


async def haproxy_version(binary: str) -> str | None:
    try:
        proc = await asyncio.create_subprocess_exec(
            binary, "-v", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        out, _ = await proc.communicate()
    except OSError:
        return None
    m = re.search(r"version (\S+)", out.decode(errors="replace"))
    return m[1] if m else None


def watch_children_without_threads() -> None:
    """Python 3.11 waits for each asyncio child (`haproxy -c`) in a thread of its own, a delay on the
    way to steering; a pidfd lets the loop wait (3.12 does)."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an older kernel, or a seccomp filter: keep the threads
        return
    asyncio.set_child_watcher(asyncio.PidfdChildWatcher())


def run_daemon(settings: Settings) -> int:
    setup_logging(settings.logging)
    watch_children_without_threads()
    try:
        return asyncio.run(Daemon(settings).run())
    except Exception:  # an ExceptionGroup from the TaskGroup included
        # A bug, not a decision: HAProxy keeps running and the next `run` adopts it.
        log.critical("haproxy-supervisor crashed; haproxy is left running for the next start", exc_info=True)
        return EXIT_CRASHED
