"""Is a worker ready: does it answer on the master CLI, and listen on every port its config binds?"""

from __future__ import annotations

import logging
import socket
import struct
from pathlib import Path

from ..haproxy.answers import ProcList, show_info_by_pid
from ..haproxy.api import CLIError, MasterCLI
from ..haproxy.config import Config
from .procfs import socket_inodes

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


# sock_diag (netlink): the kernel lists only the listening TCP sockets, however many
# connections the node holds; /proc/net/tcp would have to be read whole, with every connection.
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _TCP_LISTEN = 4, 20, 10
_NLM_F_REQUEST, _NLM_F_DUMP, _NLMSG_ERROR, _NLMSG_DONE = 0x1, 0x300, 2, 3
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, seq, pid
_DIAG_PORT_AT, _DIAG_INODE_AT = 4, 68  # in struct inet_diag_msg: idiag_sport (big endian), idiag_inode


def _listening_tcp_sockets() -> dict[int, int]:
    """{socket inode: port} of every listening TCP socket (IPv4 and IPv6) of this network namespace."""
    found: dict[int, int] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        # struct inet_diag_req_v2: family, protocol, ext, pad, states, then a zeroed inet_diag_sockid.
        request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN) + bytes(48)
        header = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY,
                                    _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
            sock.settimeout(1)
            sock.send(header + request)
            done = False
            while not done:
                data = sock.recv(1 << 16)
                offset = 0
                while offset + _NLMSG_HEADER.size <= len(data):
                    length, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, offset)
                    if kind == _NLMSG_DONE or length < _NLMSG_HEADER.size:
                        done = True
                        break
                    if kind == _NLMSG_ERROR:
                        raise OSError("sock_diag answered an error")
                    body = offset + _NLMSG_HEADER.size
                    (port,) = struct.unpack_from(">H", data, body + _DIAG_PORT_AT)
                    (inode,) = struct.unpack_from("=I", data, body + _DIAG_INODE_AT)
                    found[inode] = port
                    offset += (length + 3) & ~3
    return found


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
