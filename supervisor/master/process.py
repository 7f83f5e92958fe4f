"""The HAProxy master (`-W`, in a session of its own: a Ctrl-C reaches the daemon only): start,
adopt, watch, restart with backoff, stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil

from ..haproxy.answers import ProcList, show_info_by_pid
from ..haproxy.api import CLIError, MasterCLI
from ..haproxy.config import Config
from ..haproxy.server_state import clear_server_state
from ..haproxy.stderr import StderrRelay
from ..notify import child_environment
from ..settings import Settings
from ..state import State
from .processes import (
    find_master,
    find_masters,
    is_alive,
    is_our_master_worker,
    kill_group,
    read_pid_file,
    reap,
    send_signal,
    socket_inodes,
    watch_exit,
)
from .sockdiag import TCP_LISTEN, tcp_sockets


def bind_ports(config: Config) -> set[int]:
    """The literal TCP ports of the config's `bind` lines (ranges, unix and the like left out)."""
    ports: set[int] = set()
    for section in config.sections:
        if section.kind not in ("frontend", "listen"):
            continue
        for line in section.body:
            words = line.words
            if len(words) < 2 or words[0] != "bind" or "quic" in words[1]:
                continue
            for address in words[1].split(","):
                family, at, rest = address.rpartition("@")
                if at and family not in ("ipv4", "ipv6", "tcp", "tcp4", "tcp6"):
                    continue
                port = rest.rpartition(":")[2]
                if port.isdigit():
                    ports.add(int(port))
    return ports


def listening_ports(pid: int) -> set[int] | None:
    """None when the kernel cannot say."""
    try:
        listening = {
            found.inode: found.sport
            for family in (socket.AF_INET, socket.AF_INET6)
            for found in tcp_sockets(family, (TCP_LISTEN,))
        }
    except OSError as exc:
        log.debug("sock_diag unavailable (%s): listeners not checked", exc)
        return None
    return {listening[inode] for inode in socket_inodes(pid) if inode in listening}


async def worker_ready(cli: MasterCLI, pid: int, ports: set[int]) -> bool:
    """Does the worker answer `@!<pid>` and listen on all `ports`? (3.1 lists it before it binds.)"""
    try:
        infos = show_info_by_pid(await cli.on(pid, "show info", timeout=2))
    except CLIError:
        return False
    if pid not in infos:
        return False  # `Can't find the target PID matching the prefix`: not reachable yet
    if not ports:
        return True
    held = listening_ports(pid)
    return held is None or ports <= held


def config_ports(path: Path) -> set[int]:
    try:
        return bind_ports(Config.parse(path.read_text()))
    except (OSError, UnicodeDecodeError):
        return set()


async def ready_worker(cli: MasterCLI, master_pid: int, ports: set[int]) -> tuple[ProcList | None, str]:
    """`show proc` when it lists `master_pid` with a ready current worker, else why not."""
    try:
        procs = await cli.show_proc()
    except CLIError as exc:
        return None, str(exc)
    worker = procs.current_worker
    if procs.master is None or procs.master.pid != master_pid or worker is None:
        return None, f"show proc lists master {procs.master.pid if procs.master else None}, no current worker"
    if not await worker_ready(cli, worker.pid, ports):
        return None, f"worker {worker.pid} is listed but does not answer or listen yet"
    return procs, ""


log = logging.getLogger(__package__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_UPTIME_S = 10.0
HARD_STOP_WAIT_S = 5.0
POLL_S = 0.05


class MasterError(Exception):
    """The master could not be started or adopted."""


class MasterSocketGone(MasterError):
    """Our master lives, but its socket file was removed: reachable once it re-executes (take_back)."""

    def __init__(self, pid: int, path: Path) -> None:
        super().__init__(f"haproxy master pid={pid} still holds {path}, which was removed: "
                         "refusing to start a second HAProxy")
        self.pid = pid


# The master CLI can change what every worker routes: its owner and group only, whatever the umask.
MASTER_SOCKET_MODE = "660"
# What HAProxy creates without an explicit mode of its own is never world-accessible.
CHILD_UMASK = 0o027


def master_command(settings: Settings) -> list[str]:
    h = settings.haproxy
    return [
        h.binary, "-W", "-S", f"{h.master_socket_path},mode,{MASTER_SOCKET_MODE}",
        "-f", str(h.effective_config), "-p", str(h.pid_file),
    ]


def next_backoff(previous: float | None, uptime_s: float | None) -> float:
    """At once after a master that ran HEALTHY_UPTIME_S (a second waited is one without a listener); then doubling."""
    if previous is None or (uptime_s is not None and uptime_s >= HEALTHY_UPTIME_S):
        return 0.0
    return min(max(previous * 2, BACKOFF_FIRST_S), BACKOFF_MAX_S)


class MasterProcess:
    def __init__(
        self,
        settings: Settings,
        state: State,
        cli: MasterCLI,
        on_started: Callable[[ProcList], Awaitable[None]] | None = None,
        stderr: StderrRelay | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.cli = cli
        self.on_started = on_started
        self.stderr = stderr  # None: the master shares the daemon's stderr
        # Held by whoever changes what HAProxy runs: (re)start, stop, and each reload.
        self.lock = asyncio.Lock()
        self.pid: int | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._exit: asyncio.Future[None] | None = None
        self._wanted = asyncio.Event()
        self._up = asyncio.Event()
        self._up_since = 0.0
        self.stopping = False

    @property
    def wanted(self) -> bool:  # started or adopted: kept running
        return self._wanted.is_set()

    @property
    def up(self) -> bool:
        return self._up.is_set()

    @property
    def alive(self) -> bool:
        return self.pid is not None and self._exit is not None and not self._exit.done()

    async def wait_up(self) -> None:
        await self._up.wait()

    def request_start(self) -> None:  # the effective config is on disk
        self._wanted.set()

    def _stderr_end(self) -> int | None:
        """None: the master inherits our stderr."""
        if self.stderr is None:
            return None
        try:
            return self.stderr.write_end()
        except OSError as exc:
            log.warning("%s: cannot open (%s): haproxy writes to our stderr, server states are polled",
                        self.stderr.path, exc.strerror or exc)
            return None

    async def _wait_exit(self, timeout: float | None) -> bool:
        if self._exit is None:
            return True
        done, _ = await asyncio.wait({self._exit}, timeout=timeout)
        return bool(done)

    def _mark_up(self, pid: int) -> None:
        self.pid = pid
        self._publish_up(pid)
        self._up_since = time.monotonic()
        self._up.set()

    def _publish_up(self, pid: int) -> None:
        self.state.publish_master(pid, server_events=self.stderr is not None and self.stderr.feeds(pid))

    def _mark_down(self) -> None:
        self.state.publish_master(None)
        self._up.clear()
        self.pid = None
        self._child = None

    async def start(self) -> ProcList:
        """Start a master on the effective config on disk; return once its first worker is ready."""
        cmd = master_command(self.settings)
        ports = config_ports(self.settings.haproxy.effective_config)
        # A fresh master has no states to hand over: a previous run's file would mislead it.
        failed = clear_server_state(self.settings.haproxy.server_state_file)
        if failed is not None:
            log.warning("server-state file: cannot empty it: %s; starting haproxy without it", failed)
        self.state.publish_write("server-state file", failed)
        log.info("starting haproxy master: %s", shlex.join(cmd))
        stderr = self._stderr_end()
        try:
            child = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stderr=stderr, start_new_session=True, env=child_environment(),
                umask=CHILD_UMASK,
            )
        except OSError as exc:
            raise MasterError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None
        finally:
            if stderr is not None:
                os.close(stderr)
        self._child = child
        self._exit = exited = watch_exit(child.pid)
        deadline = time.monotonic() + self.settings.reload.timeout_s
        while True:
            if exited.done():
                how = reap(self._child)
                self._child = None
                raise MasterError(f"haproxy master pid={child.pid} exited while starting ({how}); see its messages")
            procs, why = await ready_worker(self.cli, child.pid, ports)
            if procs is not None:
                break
            if time.monotonic() > deadline:
                kill_group(child.pid)
                raise MasterError(
                    f"haproxy master pid={child.pid} has no ready worker within {self.settings.reload.timeout_s}s "
                    f"({why}): killed"
                )
            await self._wait_exit(POLL_S)
        self._mark_up(child.pid)
        worker = procs.current_worker
        log.info("master started pid=%d worker=%d", child.pid, worker.pid if worker else 0)
        return procs

    async def adopt(self) -> ProcList | None:
        """Take over the master a previous daemon started, or None; MasterError when its socket
        does not answer (a second HAProxy would bind the same ports)."""
        h = self.settings.haproxy
        pid = find_master(self.settings)
        recorded = read_pid_file(h.pid_file)
        if recorded is not None and recorded != pid:
            log.info("pid file %s names pid=%d, which is not our haproxy master: stale, ignored", h.pid_file, recorded)
        if pid is None:
            return None
        if not h.master_socket_path.exists():
            raise MasterSocketGone(pid, h.master_socket_path)
        # /healthz says it runs while a crowded master CLI is asked for a ready worker.
        self._publish_up(pid)
        ports = config_ports(self.settings.haproxy.effective_config)
        deadline = time.monotonic() + self.settings.reload.timeout_s
        while True:
            procs, why = await ready_worker(self.cli, pid, ports)
            if procs is not None:
                break
            if not is_alive(pid):
                log.info("haproxy master pid=%d went away during adoption", pid)
                self.state.publish_master(None)
                return None
            if time.monotonic() > deadline:
                self.state.publish_master(None)
                raise MasterError(
                    f"haproxy master pid={pid} is alive but {h.master_socket_path} shows no ready worker "
                    f"({why}): refusing to start a second HAProxy"
                )
            await asyncio.sleep(0.1)
        self._child = None
        self._exit = watch_exit(pid)
        self._mark_up(pid)
        self._wanted.set()
        worker = procs.current_worker
        log.info(
            "master adopted pid=%d worker=%d old_workers=%d server_events=%s",
            pid, worker.pid if worker else 0, len(procs.old_workers),
            "heard" if self.state.server_events else "polled (its stderr is not our FIFO)",
        )
        return procs

    async def reexec(self, before: ProcList | None) -> ProcList | None:
        """Re-execute our master (lock held) to bind its deleted socket; `show proc` with the new worker."""
        if self.pid is None or not self.alive:
            return None
        known = {p.pid for p in (*before.workers, *before.old_workers)} if before is not None else set()
        return await self._reexec(self.pid, known)

    async def take_back(self, pid: int) -> ProcList | None:
        """Re-execute and adopt master `pid`, whose socket file was removed while no daemon ran."""
        try:
            known = {child.pid for child in psutil.Process(pid).children()}
        except psutil.Error:
            known = set()
        if await self._reexec(pid, known) is None:
            raise MasterError(
                f"haproxy master pid={pid} holds {self.settings.haproxy.master_socket_path}, which was removed, "
                "and did not bind it again on SIGUSR2: refusing to start a second HAProxy"
            )
        return await self.adopt()

    async def _reexec(self, pid: int, known: set[int]) -> ProcList | None:
        if pid not in find_masters(self.settings):
            return None
        log.warning("master pid=%d: SIGUSR2, to read its config and bind %s again",
                    pid, self.settings.haproxy.master_socket_path)
        send_signal(pid, signal.SIGUSR2)
        deadline = time.monotonic() + self.settings.reload.timeout_s
        while time.monotonic() < deadline and is_alive(pid):
            with contextlib.suppress(CLIError):
                procs = await self.cli.show_proc()
                worker = procs.current_worker
                listed = procs.master is not None and procs.master.pid == pid
                if listed and worker is not None and worker.pid not in known:
                    return procs
            await asyncio.sleep(POLL_S)
        log.error("master pid=%d listed no new worker within %gs of SIGUSR2", pid, self.settings.reload.timeout_s)
        return None

    async def run(self) -> None:
        await self._wanted.wait()
        delay: float | None = None
        while not self.stopping:
            if self.pid is None:
                procs: ProcList | None = None
                async with self.lock:
                    if self.stopping:
                        return
                    try:
                        procs = await self.start()
                    except MasterError as exc:
                        log.error("master start failed: %s", exc)
                    # Still under the lock: no reload may run before the new worker is recorded.
                    if procs is not None and self.on_started is not None:
                        await self.on_started(procs)
                if procs is None:
                    delay = next_backoff(delay, None)
                    await self._backoff(delay)
                    continue
            await self._wait_exit(None)
            if self.stopping:
                return
            ran_for = time.monotonic() - self._up_since
            how = reap(self._child)
            log.error("master exited pid=%d (%s) after %.1fs; its workers exit with it", self.pid, how, ran_for)
            self._mark_down()
            delay = next_backoff(delay, ran_for)
            await self._backoff(delay)

    async def _backoff(self, delay: float) -> None:
        restarts = self.state.publish_master_restart()
        log.warning("master restart in %gs restarts=%d", delay, restarts)
        await asyncio.sleep(delay)

    async def stop(self) -> None:
        """Soft-stop (SIGUSR1), wait haproxy.stop_timeout_s, then SIGTERM, then SIGKILL."""
        self.stopping = True
        async with self.lock:
            if not self.alive or self.pid is None:
                log.info("stop: no haproxy master running")
                return
            pid = self.pid
            try:
                procs = await self.cli.show_proc()
                workers = [p.pid for p in (*procs.workers, *procs.old_workers)]
            except CLIError:
                workers = []
            timeout = self.settings.haproxy.stop_timeout_s
            log.info("master stopping pid=%d: soft-stop (SIGUSR1), waiting up to %gs", pid, timeout)
            send_signal(pid, signal.SIGUSR1)
            if not await self._wait_exit(timeout):
                log.warning("master pid=%d still running after %gs: hard-stop (SIGTERM)", pid, timeout)
                send_signal(pid, signal.SIGTERM)
                if not await self._wait_exit(HARD_STOP_WAIT_S):
                    log.warning("master pid=%d ignored SIGTERM for %gs: SIGKILL", pid, HARD_STOP_WAIT_S)
                    send_signal(pid, signal.SIGKILL)
                    await self._wait_exit(HARD_STOP_WAIT_S)
            how = reap(self._child)
            for worker in workers:
                # Workers leave when their master dies; make sure of it for the ones we knew.
                with contextlib.suppress(psutil.Error):  # gone: psutil.NoSuchProcess
                    proc = psutil.Process(worker)
                    if is_our_master_worker(proc.cmdline(), self.settings):
                        log.warning("worker pid=%d outlived its master: SIGKILL", worker)
                        proc.kill()
            self._mark_down()
            self.settings.haproxy.pid_file.unlink(missing_ok=True)
            log.info("master stopped pid=%d (%s)", pid, how)
