"""The daemon's sock_diag client: TCP sockets listed by the kernel, filtered there by state and
destination port, and destroyed (SOCK_DESTROY, as `ss -K`)."""

from __future__ import annotations

import functools
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, SOCK_DESTROY = 4, 20, 21
TCP_ESTABLISHED, TCP_SYN_SENT, TCP_LISTEN = 1, 2, 10
TIMER_RETRANSMIT = 1  # idiag_timer: the retransmit timer (a SYN's too) is pending

_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP, _NLMSG_ERROR, _NLMSG_DONE = 0x1, 0x4, 0x300, 2, 3
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, seq, pid
_ATTR = struct.Struct("=HH")  # struct nlattr: length, type
_INET_DIAG_REQ_BYTECODE, _INET_DIAG_INFO = 1, 2
_BC_JMP, _BC_D_EQ = 1, 12  # enum of inet_diag_bc_op codes (linux/inet_diag.h)
_BC_OP = struct.Struct("=BBH")  # struct inet_diag_bc_op: code, yes, no
# struct inet_diag_msg: family, state, timer, retrans, the 48-byte inet_diag_sockid, expires,
# rqueue, wqueue, uid, inode.
_MSG = struct.Struct("=BBBB48sIIIII")
_SOCKID = struct.Struct(">HH16s16s")  # sport, dport (big endian), src, dst; then if, cookie
_DPORT, _DPORT_AT = struct.Struct(">H"), 6  # idiag_dport, in inet_diag_msg
# struct tcp_info, as far as read: rto at 8, rtt at 68.
_TCPI_RTO_AT, _TCPI_RTT_AT = 8, 68
_TCPI_LAST_DATA_SENT_AT, _TCPI_LAST_DATA_RECV_AT = 44, 52  # ms since
_TCPI_DATA_SEGS_IN_AT = 152  # segments that carried data in (Linux 4.6 and later)
# A bytecode longer than this would overflow its jumps' 16 bits: dump by state alone then.
MAX_FILTERED_PORTS = 4000


class SockDiagError(OSError):
    """The kernel refused a request (or sock_diag is missing)."""


@dataclass(frozen=True)
class DiagSocket:

    family: int
    state: int
    src: str
    sport: int
    dst: str
    dport: int
    sockid: bytes  # the kernel's inet_diag_sockid, cookie included: what SOCK_DESTROY names it by
    timer: int
    retrans: int  # idiag_retrans: retransmissions of the pending segment (or SYN)
    expires_ms: int  # until the timer fires
    rqueue: int
    wqueue: int  # established: bytes sent and not acknowledged (Send-Q)
    inode: int
    rto_ms: float | None = None  # from tcp_info, when asked for
    rtt_ms: float | None = None
    sent_ago_ms: int | None = None  # since data was last sent, and received
    received_ago_ms: int | None = None
    data_segs_in: int | None = None  # segments with data received: 0 on a connection never answered


@functools.lru_cache(maxsize=4)
def port_filter(ports: frozenset[int]) -> bytes:
    """Bytecode that accepts a destination port in `ports`: per port a D_EQ test whose match jumps
    to the end and miss to the next test; the last miss jumps past the end (refused)."""
    wanted = sorted(ports)
    ops: list[bytes] = []
    total = 12 * len(wanted)
    for i, port in enumerate(wanted):
        last = i == len(wanted) - 1
        ops.append(_BC_OP.pack(_BC_D_EQ, 8, 16 if last else 12))
        ops.append(_BC_OP.pack(0, 0, port))
        ops.append(_BC_OP.pack(_BC_JMP, 4, total - (12 * i + 8)))
    return b"".join(ops)


def _request(kind: int, flags: int, body: bytes) -> bytes:
    return _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(body), kind, flags, 1, 0) + body


def _address(family: int, raw: bytes) -> str:
    return socket.inet_ntop(family, raw[:4] if family == socket.AF_INET else raw)


def _u32(data: bytes, at: int) -> int:
    return struct.unpack_from("=I", data, at)[0]


def _parse(data: bytes, at: int, end: int) -> DiagSocket:
    family, state, timer, retrans, sockid, expires, rqueue, wqueue, _, inode = _MSG.unpack_from(data, at)
    sport, dport, src, dst = _SOCKID.unpack_from(sockid)
    tcp_info: dict[str, Any] = {}
    offset = at + _MSG.size
    while offset + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size:
            break
        if kind == _INET_DIAG_INFO and length >= _ATTR.size + _TCPI_RTT_AT + 4:
            info = offset + _ATTR.size
            tcp_info.update(
                rto_ms=_u32(data, info + _TCPI_RTO_AT) / 1000, rtt_ms=_u32(data, info + _TCPI_RTT_AT) / 1000,
                sent_ago_ms=_u32(data, info + _TCPI_LAST_DATA_SENT_AT),
                received_ago_ms=_u32(data, info + _TCPI_LAST_DATA_RECV_AT),
            )
            if length >= _ATTR.size + _TCPI_DATA_SEGS_IN_AT + 4:
                tcp_info["data_segs_in"] = _u32(data, info + _TCPI_DATA_SEGS_IN_AT)
        offset += (length + 3) & ~3
    return DiagSocket(
        family, state, _address(family, src), sport, _address(family, dst), dport, sockid, timer, retrans,
        expires, rqueue, wqueue, inode, **tcp_info,
    )


def tcp_sockets(
    family: int, states: Iterable[int], ports: Iterable[int] | None = None, info: bool = False
) -> Iterator[DiagSocket]:
    """TCP sockets in one of `states`, toward one of `ports` if given; `info`: with tcp_info."""
    mask = sum(1 << state for state in set(states))
    wanted = frozenset(ports) if ports is not None else None
    bytecode = port_filter(wanted) if wanted and len(wanted) <= MAX_FILTERED_PORTS else b""
    if wanted is not None and not wanted:
        return
    ext = 1 << (_INET_DIAG_INFO - 1) if info else 0
    # struct inet_diag_req_v2: family, protocol, ext, pad, states, then a zeroed inet_diag_sockid.
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, ext, 0, mask) + bytes(48)
    if bytecode:
        body += _ATTR.pack(_ATTR.size + len(bytecode), _INET_DIAG_REQ_BYTECODE) + bytecode
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1)
        sock.send(_request(SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, body))
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + _NLMSG_HEADER.size <= len(data):
                length, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, offset)
                if kind == _NLMSG_DONE or length < _NLMSG_HEADER.size:
                    return
                if kind == _NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, offset + _NLMSG_HEADER.size)
                    raise SockDiagError(-errno, f"sock_diag dump refused: {-errno}")
                body = offset + _NLMSG_HEADER.size
                # Past the bytecode's reach the port is checked here, before the socket is parsed.
                if wanted is None or bytecode or _DPORT.unpack_from(data, body + _DPORT_AT)[0] in wanted:
                    yield _parse(data, body, offset + length)
                offset += (length + 3) & ~3


class TcpCounters(NamedTuple):
    opens: int  # ActiveOpens: connects begun
    failed: int  # AttemptFails: connects (and accepted handshakes) that ended before ESTABLISHED
    retrans: int  # RetransSegs


class TcpActivity:
    """TCP counters (/proc/net/snmp): when no socket can have stalled, no dump is needed (one
    walks the whole established hash). The file stays open, read again from offset 0."""

    PATH = "/proc/net/snmp"
    _BUFFER = 1 << 13  # the whole file: a few hundred bytes past the Tcp lines
    _NAMES = (b"ActiveOpens", b"AttemptFails", b"RetransSegs")

    def __init__(self) -> None:
        self._fd: int | None = None
        self._columns: tuple[int, ...] | None = None  # of _NAMES, found once

    def read(self) -> TcpCounters | None:
        """None when unreadable (it is opened again next time)."""
        try:
            if self._fd is None:
                self._fd = os.open(self.PATH, os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(self._fd, self._BUFFER, 0)
            header = data.index(b"\nTcp: ") + 6
            start = data.index(b"\nTcp: ", header) + 6
            if self._columns is None:
                names = data[header:data.index(b"\n", header)].split()
                self._columns = tuple(names.index(name) for name in self._NAMES)
            values = data[start:data.index(b"\n", start)].split()
            return TcpCounters(*(int(values[column]) for column in self._columns))
        except (OSError, IndexError, ValueError):
            self.close()
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def destroy(target: DiagSocket) -> None:
    """Close `target` (a pending connect fails with ECONNABORTED); needs CAP_NET_ADMIN, else SockDiagError."""
    body = struct.pack("=BBBBI", target.family, socket.IPPROTO_TCP, 0, 0, 1 << target.state) + target.sockid
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1)
        sock.send(_request(SOCK_DESTROY, _NLM_F_REQUEST | _NLM_F_ACK, body))
        data = sock.recv(1 << 12)
    _, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, 0)
    if kind == _NLMSG_ERROR:
        (errno,) = struct.unpack_from("=i", data, _NLMSG_HEADER.size)
        if errno:
            raise SockDiagError(-errno, f"SOCK_DESTROY refused: {-errno}")
