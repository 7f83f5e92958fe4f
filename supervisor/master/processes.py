"""Processes as the kernel shows them: whether one lives, when it started and which sockets it
holds (/proc); its end, waited for without a thread (a pidfd, readable once the process has
exited; Linux 5.3+), described, or brought about; and `WorkerExits`, which notices an old
worker's exit without asking the master, so that a worker that drained and left is listed
again at once, while at rest `show proc` is asked only now and then.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

import psutil


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds (its /proc/<pid>/fd links `socket:[N]`)."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError), os.scandir(f"/proc/{pid}/fd") as fds:
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def process_started_at(pid: int) -> datetime | None:
    """When a process started (wall clock), or None if it is gone or hidden."""
    try:
        return datetime.fromtimestamp(psutil.Process(pid).create_time(), UTC)
    except psutil.Error:
        return None


def watch_exit(pid: int) -> asyncio.Future[None]:
    """A future of the running loop that is done once process `pid` has exited.

    A pidfd becomes readable when its process exits, whether or not it is our child: no
    thread, no polling. Done at once if the process is already gone.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        done.set_result(None)
        return done

    def exited() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, exited)
    return done


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exit status unknown: not our child"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def reap(child: subprocess.Popen[bytes] | None) -> str:
    """Collect an exited child's status and describe it (no status for a process not our child)."""
    if child is None:
        return describe_exit(None)
    try:
        code = child.wait(timeout=1)
    except subprocess.TimeoutExpired:
        code = None
    return describe_exit(code)


def send_signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def kill_group(pid: int) -> None:
    """SIGKILL the session `pid` leads: a master we just started, and its workers with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class WorkerExits:
    """Calls `exited()` when any watched process exits."""

    def __init__(self, exited: Callable[[], None]) -> None:
        self._exited = exited
        self._fds: dict[int, int] = {}

    def watch_only(self, pids: Iterable[int]) -> None:
        """Watch these processes, and no other."""
        wanted = set(pids)
        for pid in [pid for pid in self._fds if pid not in wanted]:
            self._forget(pid)
        for pid in wanted - self._fds.keys():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._exited()  # gone already
                continue
            except OSError:
                continue  # no pidfd here: the periodic listing notices it
            self._fds[pid] = fd
            asyncio.get_running_loop().add_reader(fd, self._readable, pid)

    def close(self) -> None:
        for pid in list(self._fds):
            self._forget(pid)

    def _readable(self, pid: int) -> None:
        self._forget(pid)
        self._exited()

    def _forget(self, pid: int) -> None:
        fd = self._fds.pop(pid)
        with contextlib.suppress(ValueError, RuntimeError):
            asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
