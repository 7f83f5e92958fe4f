"""Recognising our master and its workers: by the master socket a process holds, and by argv."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import psutil

from ..settings import Settings
from .processes import is_alive, process_started_at, socket_inodes

log = logging.getLogger(__package__)


def _arg_after(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[i + 1]
    return None


def is_our_master(cmdline: Sequence[str], settings: Settings) -> bool:
    """Is this argv a master-worker HAProxy started for our runtime_dir?

    Only for telling our workers apart from other processes (`is_our_master_worker`): a
    master itself is recognised by the socket it holds (`find_master`), since from 3.2 on
    its own argv after a reload reads `haproxy -sf <old> -x sockpair@4 -W ...`, like a worker's.
    """
    if len(cmdline) < 2 or "haproxy" not in Path(cmdline[0]).name or "-W" not in cmdline:
        return False
    socket_arg = _arg_after(cmdline, "-S")
    config_arg = _arg_after(cmdline, "-f")
    # `-S <path>[,<bind options>]`
    return (
        socket_arg is not None
        and socket_arg.split(",", 1)[0] == str(settings.haproxy.master_socket_path)
        and config_arg == str(settings.haproxy.effective_config)
    )


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


def _listening_unix_sockets(net_unix: str) -> list[tuple[int, str]]:
    """(inode, bound path) of every listening unix socket in a /proc/net/unix text."""
    sockets: list[tuple[int, str]] = []
    for line in net_unix.splitlines()[1:]:
        fields = line.split(None, 7)
        if len(fields) == 8 and int(fields[3], 16) & _UNIX_LISTENING and fields[6].isdigit():
            sockets.append((int(fields[6]), fields[7]))
    return sockets


def master_socket_candidates(net_unix: str, socket_path: Path) -> list[tuple[int, int | None]]:
    """(socket inode, PID named by the bound name or None) of the listeners bound at `socket_path`.

    HAProxy binds a unix socket as `<path>.<pid>.tmp` and renames it into place, so the kernel
    keeps that name, with the PID of the master that bound it: a master keeps its PID when it
    re-executes on reload, and the name stays when the file is removed since.
    """
    path = str(socket_path)
    found: list[tuple[int, int | None]] = []
    for inode, name in _listening_unix_sockets(net_unix):
        if name == path:
            found.append((inode, None))
        elif name.startswith(path + ".") and name.endswith(".tmp"):
            pid = name[len(path) + 1 : -len(".tmp")]
            if pid.isdigit():
                found.append((inode, int(pid)))
    return found


def find_masters(settings: Settings) -> list[int]:
    """PIDs of the live HAProxy masters serving this runtime_dir's master socket, oldest first.

    Found by process facts, never by argv or the pid file: a master is a live process that holds
    the listening unix socket bound at `haproxy.master_socket_path`, including when that file
    was removed since (a recreated runtime_dir). Usually one; more than one means a second
    master was started beside the first. Reads /proc only (no HAProxy CLI), so it also works
    when the socket no longer answers. A worker never holds the master socket.
    """
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
    """The PID of the live HAProxy master of this runtime_dir (the oldest if several), or None.

    Call it before starting a master: while it returns a PID, starting another one would bind
    the same ports twice. See `find_masters`.
    """
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
