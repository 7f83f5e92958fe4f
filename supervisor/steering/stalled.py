"""Which servers are suspect: the kernel's view of the workers' sockets toward them, judged.

A vanished node never answers: a connect to it stays in SYN-SENT, and data sent on an
established connection to it stays unacknowledged while TCP retransmits it. Both show in
sock_diag at once, long before a `timeout connect` or a health check concludes. A server with
such a socket, stalled for longer than a threshold, is suspect. The threshold follows the
round-trip times seen toward the server (a WAN server's connect takes longer), with a floor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

from ..master.sockdiag import TCP_ESTABLISHED, TCP_SYN_SENT, TIMER_RETRANSMIT, DiagSocket

Endpoint = tuple[str, int]  # (address, port) of a server as its sockets name it

# A connect or a segment is stalled past this many round trips (and the floor).
RTT_FACTOR = 8


@dataclass(frozen=True)
class Stall:
    """One worker socket that is stalled: why, and for at least how long."""

    endpoint: Endpoint
    why: str  # "connect" (SYN-SENT) or "retransmit" (established, data unacknowledged)
    age_ms: float  # a lower bound, from the kernel's timer (and first sight)
    socket: DiagSocket


@dataclass(frozen=True)
class Suspect:
    """A server the detector holds to be unreachable."""

    key: str  # "backend/server"
    endpoint: Endpoint
    why: str
    since: float  # time.time() of when its oldest stalled socket stalled


def stall_of(sock: DiagSocket, first_seen_ago_ms: float = 0.0) -> Stall | None:
    """Is this socket stalled, and since when at least? The current retransmit interval has
    lasted rto - expires; with retransmissions behind it, the intervals before (each half the
    next) at least another rto/2."""
    if sock.timer != TIMER_RETRANSMIT:
        return None
    if sock.state == TCP_SYN_SENT:
        why = "connect"
    elif sock.state == TCP_ESTABLISHED and sock.wqueue > 0 and sock.retrans > 0:
        why = "retransmit"
    else:
        return None
    rto = sock.rto_ms if sock.rto_ms is not None else 1000.0 if why == "connect" else 200.0
    age = max(0.0, rto - sock.expires_ms) + (rto / 2 if sock.retrans > 0 else 0.0)
    return Stall((sock.dst, sock.dport), why, max(age, first_seen_ago_ms), sock)


def threshold_ms(rtts_ms: Iterable[float], floor_ms: float) -> float:
    """How long a stall must last to count: RTT_FACTOR of the slowest round trip seen toward the
    server, never under `floor_ms`."""
    slowest = max(rtts_ms, default=0.0)
    return max(floor_ms, RTT_FACTOR * slowest)


def suspects(
    stalls: Iterable[Stall],
    servers: Mapping[Endpoint, tuple[str, ...]],
    rtts_ms: Mapping[Endpoint, float],
    floor_ms: float,
    now: float,
) -> dict[str, Suspect]:
    """The servers whose endpoint has a stall older than its threshold, by "backend/server"
    (every server of the current config at that endpoint), each with why and since when."""
    found: dict[str, Suspect] = {}
    for stall in stalls:
        keys = servers.get(stall.endpoint)
        if not keys:
            continue
        rtt = rtts_ms.get(stall.endpoint)
        if stall.age_ms < threshold_ms(() if rtt is None else (rtt,), floor_ms):
            continue
        since = now - stall.age_ms / 1000
        for key in keys:
            known = found.get(key)
            if known is None or since < known.since:
                found[key] = Suspect(key, stall.endpoint, stall.why, since)
    return found


def left_in(suspect_keys: Iterable[str], backends: Mapping[str, tuple[str, ...]], dead: Set[str]) -> set[str]:
    """The suspects the current worker keeps routing to: those of a backend in which every
    server it could route to (backups included) is suspect or known dead. A live server with a
    full accept queue stalls connects exactly as a vanished one does; while a backend has
    another server, taking the suspect out costs nothing, but taking out its last would turn a
    slow answer into a sure 503. Such a backend is left as HAProxy has it (Envoy's panic mode)."""
    suspect = set(suspect_keys)
    by_backend: dict[str, list[str]] = {}
    for key in suspect:
        by_backend.setdefault(key.partition("/")[0], []).append(key)
    kept: set[str] = set()
    for backend, keys in by_backend.items():
        servers = backends.get(backend, ())
        if not any(s not in suspect and s not in dead for s in servers):
            kept.update(keys)
    return kept


def idle(sock: DiagSocket) -> bool:
    """An established connection with nothing in flight either way: a pooled idle one. Its
    queues are empty and its last data came in after its last data went out; a request sent
    and acknowledged whose answer is still being worked out has empty queues too, and so has
    a connection just opened, that no answer has come in on yet: its request is on its way."""
    if sock.state != TCP_ESTABLISHED or sock.wqueue or sock.rqueue or sock.data_segs_in == 0:
        return False
    return sock.sent_ago_ms is None or sock.received_ago_ms is None or sock.received_ago_ms <= sock.sent_ago_ms


def to_abort(
    stalls: Iterable[Stall],
    owners: Mapping[int, int],
    keys_at: Mapping[Endpoint, tuple[str, ...]],
    held: Set[str],
    current_pid: int | None,
    steered: Mapping[int, Set[str]],
    own_keys_at: Mapping[int, Mapping[Endpoint, tuple[str, ...]]],
    dead: Set[str],
    kept: Set[str] = frozenset(),
) -> list[tuple[Stall, str]]:
    """The stalled sockets to destroy, each with why ("suspect" or "dead"), seen at once
    (whatever their age): no threshold stands between a known-unreachable server and the
    retry HAProxy makes once the connect fails.

    - "suspect": toward a held suspect (`held`: its keys; `keys_at`: every running config's
      servers per endpoint), in a worker that routes nothing more to a server at that
      endpoint: the current worker (the suspect is set down there in the same poll), or an
      old worker whose last push steered it off one (`steered`). Not the suspects the current
      worker keeps (`kept`, left_in()): a server with a full accept queue may still take them
      (its kernel drops the handshake's last ACK too, so even an established one retransmits).
    - "dead": a connect (SYN-SENT) of an old worker toward an endpoint where every server of
      that worker's own config (`own_keys_at`) is known dead (`dead`) and steered off in it:
      its retry is redispatched to a live server. Another backend of the same config that
      still routes to the endpoint keeps its connects.
    `owners`: socket inode -> worker PID; a socket of no worker is left alone."""
    found: list[tuple[Stall, str]] = []
    for stall in stalls:
        pid = owners.get(stall.socket.inode)
        if pid is None:
            continue
        off = steered.get(pid, frozenset())
        keys = keys_at.get(stall.endpoint, ())
        if pid == current_pid:
            suspect = any(k in held and k not in kept for k in keys)
        else:
            suspect = any(k in held for k in keys) and any(k in off for k in keys)
        if suspect:
            found.append((stall, "suspect"))
            continue
        if pid == current_pid or stall.why != "connect":
            continue
        mine = own_keys_at.get(pid, {}).get(stall.endpoint, ())
        if mine and all(k in off and k in dead for k in mine):
            found.append((stall, "dead"))
    return found
