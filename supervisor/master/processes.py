"""Processes by /proc and pidfds: which are our master (by the socket it holds) and workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

import psutil

from ..settings import Settings


def socket_inodes(pid: int) -> dict[int, int]:
    """{inode: file descriptor} of the sockets `pid` holds."""
    inodes: dict[int, int] = {}
    with contextlib.suppress(OSError), os.scandir(f"/proc/{pid}/fd") as fds:
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes[int(target[8:-1])] = int(fd.name)
    return inodes


def still_open(pid: int, sockets: Mapping[int, int]) -> dict[int, int]:
    """Those of `sockets` ({inode: file descriptor}) that `pid` still holds."""
    held = {}
    for inode, fd in sockets.items():
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                held[inode] = fd
    return held


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.ZombieProcess:
        return False
    except psutil.Error:
        # Hidden from us (another user's, under hidepid): the kernel still says if it exists.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def process_started_at(pid: int) -> datetime | None:
    try:
        return datetime.fromtimestamp(psutil.Process(pid).create_time(), UTC)
    except psutil.Error:
        return None


def watch_exit(pid: int) -> asyncio.Future[None]:
    """Done once process `pid` has exited, our child or not."""
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
    code = None
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = child.wait(timeout=1)
    return describe_exit(code)


def send_signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def kill_group(pid: int) -> None:
    """A master we just started, and its workers with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class WorkerExits:
    """Calls `exited()` when any watched process exits: an old worker's exit noticed at once."""

    def __init__(self, exited: Callable[[], None]) -> None:
        self._exited = exited
        self._fds: dict[int, int] = {}

    def watch_only(self, pids: Iterable[int]) -> None:
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


log = logging.getLogger(__package__)


def _arg_after(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[i + 1]
    return None


def is_our_master(cmdline: Sequence[str], settings: Settings) -> bool:
    """Is this argv a master-worker HAProxy for our runtime_dir? Only for workers: from 3.2 a
    master's argv after a reload reads like one."""
    if len(cmdline) < 2 or "haproxy" not in Path(cmdline[0]).name or "-W" not in cmdline:
        return False
    socket_path = (_arg_after(cmdline, "-S") or "").split(",", 1)[0]  # `-S <path>[,<bind options>]`
    h = settings.haproxy
    return socket_path == str(h.master_socket_path) and _arg_after(cmdline, "-f") == str(h.effective_config)


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


# /proc/net/unix: `Num RefCount Protocol Flags Type St Inode Path`; Flags 00010000 = listening.
_UNIX_LISTENING = 0x10000


def master_socket_candidates(net_unix: str, socket_path: Path) -> list[tuple[int, int | None]]:
    """(inode, PID or None) of the listeners bound at `socket_path`: HAProxy binds
    `<path>.<pid>.tmp` and renames it, and the kernel keeps that name even once it is removed."""
    path = str(socket_path)
    found: list[tuple[int, int | None]] = []
    for line in net_unix.splitlines()[1:]:
        fields = line.split(None, 7)
        if len(fields) != 8 or not int(fields[3], 16) & _UNIX_LISTENING or not fields[6].isdigit():
            continue
        inode, name = int(fields[6]), fields[7]
        if name == path:
            found.append((inode, None))
        elif name.startswith(path + ".") and name.endswith(".tmp"):
            pid = name[len(path) + 1 : -len(".tmp")]
            if pid.isdigit():
                found.append((inode, int(pid)))
    return found


def find_masters(settings: Settings) -> list[int]:
    """Live processes holding the master socket (its file removed or not), oldest first; from
    /proc only, so it works when the socket does not answer."""
    try:
        net_unix = Path("/proc/net/unix").read_text()
    except OSError:
        return []
    pids: set[int] = set()
    for inode, named in master_socket_candidates(net_unix, settings.haproxy.master_socket_path):
        if named is not None and inode in socket_inodes(named):
            holders = [named]
        else:  # not bound under a `.<pid>.tmp` name, or that PID was reused: look at every process
            holders = [pid for pid in psutil.pids() if inode in socket_inodes(pid)]
        pids.update(pid for pid in holders if is_alive(pid))

    def oldest_first(pid: int) -> tuple[bool, float, int]:
        started = process_started_at(pid)  # None: gone meanwhile, sorted last
        return (started is None, started.timestamp() if started is not None else 0.0, pid)

    return sorted(pids, key=oldest_first)


def find_master(settings: Settings) -> int | None:
    masters = find_masters(settings)
    if len(masters) > 1:
        log.warning("several haproxy masters hold %s: pids=%s; the oldest is ours",
                    settings.haproxy.master_socket_path, masters)
    return masters[0] if masters else None


def read_pid_file(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None
