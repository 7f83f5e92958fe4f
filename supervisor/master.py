"""The HAProxy master process: start, adopt, watch, restart with backoff, stop.

One object owns the master the way gunicorn's Arbiter owns its workers. HAProxy
runs in master-worker mode in the foreground (`-W`, no `-D`), as our child in a
session of its own, so a Ctrl-C on the daemon's terminal reaches the daemon only.
Its stdout and stderr are the daemon's: under systemd that is the journal, which
outlives the daemon, so HAProxy never writes into a pipe nobody reads after a
daemon crash.

A master that is not our child (adopted after a daemon restart) is watched through
a pidfd, which becomes readable when the process exits; a child is watched the
same way and reaped. No thread, no polling.

HAProxy's signals in master-worker mode (checked on 2.6.12): SIGUSR1 to the master
soft-stops every worker and the master exits once they are all gone; SIGTERM (and
SIGINT) hard-stop them. When the master dies, its workers notice (their pipe to the
master closes) and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import psutil

from .haproxy.api import CLIError, MasterCLI, ProcList
from .haproxy.server_state import clear_server_state
from .notify import child_environment
from .settings import Settings
from .state import State

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
HARD_STOP_WAIT_S = 5.0
POLL_S = 0.05


class MasterError(Exception):
    """The master could not be started or adopted. One line."""


# The master CLI can change what every worker routes: its owner and group only, whatever the
# umask (HAProxy creates the socket; `-S path,mode,660` is a bind option of its own).
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
    """1 s, 2 s, 4 s ... up to 30 s between restarts; back to 1 s after a master that ran
    longer than the cap (its death is then news, not a crash loop)."""
    if previous is None or (uptime_s is not None and uptime_s >= BACKOFF_MAX_S):
        return BACKOFF_FIRST_S
    return min(previous * 2, BACKOFF_MAX_S)


def _arg_after(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[i + 1]
    return None


def is_our_master(cmdline: Sequence[str], settings: Settings) -> bool:
    """Is this argv a master started for our runtime_dir? A reused PID or another
    HAProxy on the machine must never be adopted (nor signalled)."""
    if len(cmdline) < 2 or Path(cmdline[0]).name != Path(settings.haproxy.binary).name:
        return False
    if "-W" not in cmdline or "-sf" in cmdline or "-x" in cmdline:  # -sf/-x: a worker's argv after a reload
        return False
    socket_arg = _arg_after(cmdline, "-S")
    config_arg = _arg_after(cmdline, "-f")
    # `-S <path>[,<bind options>]`
    return (
        socket_arg is not None
        and socket_arg.split(",", 1)[0] == str(settings.haproxy.master_socket_path)
        and config_arg == str(settings.haproxy.effective_config)
    )


def read_pid_file(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exit status unknown: not our child"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class MasterProcess:
    """Start or adopt the master, notice its death, restart it with backoff, stop it gracefully."""

    def __init__(
        self,
        settings: Settings,
        state: State,
        cli: MasterCLI,
        on_started: Callable[[ProcList], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.cli = cli
        self.on_started = on_started
        # Held by whoever changes what HAProxy runs: (re)start, stop, and each reload.
        self.lock = asyncio.Lock()
        self.pid: int | None = None
        self.adopted = False
        self._child: subprocess.Popen[bytes] | None = None
        self._exit: asyncio.Future[None] | None = None
        self._wanted = asyncio.Event()
        self._up = asyncio.Event()
        self._up_since = 0.0
        self.stopping = False

    # ------------------------------------------------------------ facts

    @property
    def wanted(self) -> bool:
        """A master was started or adopted and should be kept running."""
        return self._wanted.is_set()

    @property
    def up(self) -> bool:
        return self._up.is_set()

    @property
    def alive(self) -> bool:
        return self.pid is not None and self._exit is not None and not self._exit.done()

    async def wait_up(self) -> None:
        await self._up.wait()

    def request_start(self) -> None:
        """Ask run() to start the master (the effective config is on disk)."""
        self._wanted.set()

    def _is_our_haproxy(self, pid: int) -> bool:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            return is_our_master(proc.cmdline(), self.settings)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    # ------------------------------------------------------------ exit watching

    def _watch_exit(self, pid: int) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._exit = done
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            done.set_result(None)
            return

        def exited() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, exited)

    def _reap(self) -> str:
        if self._child is None:
            return describe_exit(None)
        try:
            code = self._child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return describe_exit(code)

    async def _wait_exit(self, timeout: float | None) -> bool:
        if self._exit is None:
            return True
        done, _ = await asyncio.wait({self._exit}, timeout=timeout)
        return bool(done)

    def _mark_up(self, pid: int) -> None:
        self.pid = pid
        self.state.master_pid = pid
        self.state.master_up = True
        self._up_since = time.monotonic()
        self._up.set()

    def _mark_down(self) -> None:
        self.state.master_up = False
        self.state.master_pid = None
        self._up.clear()
        self.pid = None
        self._child = None

    # ------------------------------------------------------------ start / adopt

    async def start(self) -> ProcList:
        """Start a master on the effective config on disk; return once its first worker is listed."""
        cmd = master_command(self.settings)
        # A fresh master has no worker to hand states over from: a previous run's file would
        # put servers in states nobody asked for.
        clear_server_state(self.settings.haproxy.server_state_file)
        log.info("starting haproxy master: %s", shlex.join(cmd))
        try:
            child = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=child_environment(), umask=CHILD_UMASK,
            )
        except OSError as exc:
            raise MasterError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None
        self._child = child
        self.adopted = False
        self._watch_exit(child.pid)
        assert self._exit is not None
        deadline = time.monotonic() + self.settings.reload.timeout_s
        while True:
            if self._exit.done():
                how = self._reap()
                self._child = None
                raise MasterError(f"haproxy master pid={child.pid} exited while starting ({how}); see its messages")
            try:
                procs = await self.cli.show_proc()
                if procs.master is not None and procs.master.pid == child.pid and procs.current_worker is not None:
                    break
            except CLIError:
                pass
            if time.monotonic() > deadline:
                self._kill_group(child.pid)
                raise MasterError(
                    f"haproxy master pid={child.pid} listed no worker within {self.settings.reload.timeout_s}s: killed"
                )
            await self._wait_exit(POLL_S)
        self._mark_up(child.pid)
        worker = procs.current_worker
        log.info("master started pid=%d worker=%d", child.pid, worker.pid if worker else 0)
        return procs

    async def adopt(self) -> ProcList | None:
        """Take over a master a previous daemon started for this runtime_dir, or None if there is none.

        Raises MasterError when our master is alive but its socket does not answer: starting a
        second HAProxy next to it would bind the same ports twice.
        """
        h = self.settings.haproxy
        pid = read_pid_file(h.pid_file)
        if pid is not None and not self._is_our_haproxy(pid):
            log.info("pid file %s names pid=%d, which is not our haproxy master: stale, ignored", h.pid_file, pid)
            pid = None
        if pid is None:
            if not h.master_socket_path.exists():
                return None
            # The pid file may be gone while the master runs: its socket knows the PID too.
            try:
                procs = await self.cli.show_proc()
            except CLIError:
                return None
            if procs.master is None or not self._is_our_haproxy(procs.master.pid):
                return None
            pid = procs.master.pid
        deadline = time.monotonic() + self.settings.reload.timeout_s
        last_error = "no answer"
        while True:
            try:
                procs = await self.cli.show_proc()
                if procs.master is not None and procs.master.pid == pid and procs.current_worker is not None:
                    break
                last_error = f"show proc lists master {procs.master.pid if procs.master else None}, no current worker"
            except CLIError as exc:
                last_error = str(exc)
            if not self._is_our_haproxy(pid):
                log.info("haproxy master pid=%d went away during adoption", pid)
                return None
            if time.monotonic() > deadline:
                raise MasterError(
                    f"haproxy master pid={pid} is alive but {h.master_socket_path} does not answer `show proc` "
                    f"({last_error}): refusing to start a second HAProxy"
                )
            await asyncio.sleep(0.1)
        self._child = None
        self.adopted = True
        self._watch_exit(pid)
        self._mark_up(pid)
        self._wanted.set()
        worker = procs.current_worker
        log.info(
            "master adopted pid=%d worker=%d old_workers=%d",
            pid, worker.pid if worker else 0, len(procs.old_workers),
        )
        return procs

    # ------------------------------------------------------------ supervision

    async def run(self) -> None:
        """Keep the master running once it is wanted: restart it with backoff when it dies."""
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
            how = self._reap()
            log.error("master exited pid=%d (%s) after %.1fs; its workers exit with it", self.pid, how, ran_for)
            self._mark_down()
            delay = next_backoff(delay, ran_for)
            await self._backoff(delay)

    async def _backoff(self, delay: float) -> None:
        self.state.master_restarts += 1
        log.warning("master restart in %.0fs restarts=%d", delay, self.state.master_restarts)
        await asyncio.sleep(delay)

    # ------------------------------------------------------------ stop

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
            self._signal(pid, signal.SIGUSR1)
            if not await self._wait_exit(timeout):
                log.warning("master pid=%d still running after %gs: hard-stop (SIGTERM)", pid, timeout)
                self._signal(pid, signal.SIGTERM)
                if not await self._wait_exit(HARD_STOP_WAIT_S):
                    log.warning("master pid=%d ignored SIGTERM for %gs: SIGKILL", pid, HARD_STOP_WAIT_S)
                    self._signal(pid, signal.SIGKILL)
                    await self._wait_exit(HARD_STOP_WAIT_S)
            how = self._reap()
            for worker in workers:
                # Workers leave when their master dies; make sure of it for the ones we knew.
                if psutil.pid_exists(worker):
                    with contextlib.suppress(psutil.Error):
                        proc = psutil.Process(worker)
                        if is_our_master_worker(proc.cmdline(), self.settings):
                            log.warning("worker pid=%d outlived its master: SIGKILL", worker)
                            proc.kill()
            self._mark_down()
            self.settings.haproxy.pid_file.unlink(missing_ok=True)
            log.info("master stopped pid=%d (%s)", pid, how)

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def _kill_group(self, pid: int) -> None:
        # A master we just started leads its own session: kill it and its workers together.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def is_our_master_worker(cmdline: Sequence[str], settings: Settings) -> bool:
    """A worker's argv repeats the master's, with `-sf <pids...>` and `-x <socket>` after a reload."""
    kept: list[str] = []
    i = 0
    while i < len(cmdline):
        arg = cmdline[i]
        if arg in ("-sf", "-st"):
            i += 1
            while i < len(cmdline) and cmdline[i].isdigit():
                i += 1
            continue
        if arg == "-x":
            i += 2
            continue
        kept.append(arg)
        i += 1
    return is_our_master(kept, settings)
