"""Is a worker ready: does it answer on the master CLI, and listen on every port its config binds?"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from ..haproxy.answers import ProcList, show_info_by_pid
from ..haproxy.api import CLIError, MasterCLI
from ..haproxy.config import Config
from .processes import socket_inodes
from .sockdiag import TCP_LISTEN, tcp_sockets

log = logging.getLogger(__package__)


def bind_ports(config: Config) -> set[int]:
    """The TCP ports the config's `bind` lines listen on (literal ports; ranges, unix and the
    like are left out: they cannot be checked this simply)."""
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


def _listening_tcp_sockets() -> dict[int, int]:
    """{socket inode: port} of every listening TCP socket (IPv4 and IPv6) of this network namespace."""
    return {
        found.inode: found.sport
        for family in (socket.AF_INET, socket.AF_INET6)
        for found in tcp_sockets(family, (TCP_LISTEN,))
    }


def listening_ports(pid: int) -> set[int] | None:
    """The TCP ports process `pid` holds a listening socket on; None when the kernel cannot say."""
    try:
        listening = _listening_tcp_sockets()
    except OSError as exc:
        log.debug("sock_diag unavailable (%s): listeners not checked", exc)
        return None
    return {listening[inode] for inode in socket_inodes(pid) if inode in listening}


async def worker_ready(cli: MasterCLI, pid: int, ports: set[int]) -> bool:
    """Does the worker answer `@!<pid>` on the master CLI, and listen on every port in `ports`?

    Being listed by `show proc` is not enough: from 3.1 on the master lists a new worker before
    that worker has loaded its config, bound its ports or can be reached through the master.
    The listening sockets come from the kernel (sock_diag), matched to the worker's own fds;
    a fresh worker holds few, so this stays cheap on a node with many connections.
    """
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
    """The ports the effective config at `path` binds: what a ready worker listens on."""
    try:
        return bind_ports(Config.parse(path.read_text()))
    except (OSError, UnicodeDecodeError):
        return set()


async def ready_worker(cli: MasterCLI, master_pid: int, ports: set[int]) -> tuple[ProcList | None, str]:
    """`show proc` when it lists `master_pid` with a current worker that is ready, else why not."""
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
