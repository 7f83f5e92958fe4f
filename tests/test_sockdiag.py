"""The sock_diag client against real sockets, in a network namespace: the kernel's filter by
state and port, a stalled connect and an unacknowledged send seen as stalls, SOCK_DESTROY."""

from __future__ import annotations

import contextlib
import errno
import socket
import time

from rigs.netns import drop_port, needs_netns, run_in_netns
from supervisor.master.sockdiag import (
    TCP_ESTABLISHED,
    TCP_LISTEN,
    TCP_SYN_SENT,
    DiagSocket,
    TcpActivity,
    destroy,
    port_filter,
    tcp_sockets,
)
from supervisor.steering.detector import idle, stall_of


def _pending_connect(port: int) -> socket.socket:
    client = socket.socket()
    client.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        client.connect(("127.0.0.1", port))
    return client


def _filtered_and_stalled() -> dict[str, object]:
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen()
    live_port = live.getsockname()[1]
    held = socket.create_connection(("127.0.0.1", live_port))
    peer, _ = live.accept()
    drop_port(9998)
    stuck = _pending_connect(9998)
    time.sleep(0.3)
    both = [(s.state, s.dport) for s in tcp_sockets(socket.AF_INET, (TCP_SYN_SENT, TCP_ESTABLISHED), {9998, live_port})]
    only_live = [(s.state, s.dport) for s in tcp_sockets(socket.AF_INET, (TCP_SYN_SENT, TCP_ESTABLISHED), {live_port})]
    syn_only = [(s.state, s.dport) for s in tcp_sockets(socket.AF_INET, (TCP_SYN_SENT,), {9998, live_port})]
    listening = {s.sport for s in tcp_sockets(socket.AF_INET, (TCP_LISTEN,))}
    # more ports than a bytecode holds: filtered here
    many_ports = [s.dport for s in tcp_sockets(socket.AF_INET, (TCP_SYN_SENT,), range(5000, 10_000))]
    (syn,) = [s for s in tcp_sockets(socket.AF_INET, (TCP_SYN_SENT,), {9998}, info=True)]
    syn_stall = stall_of(syn)
    (healthy,) = [s for s in tcp_sockets(socket.AF_INET, (TCP_ESTABLISHED,), {live_port}, info=True)]
    # A partition of the established connection: its data is never acknowledged.
    drop_port(live_port, both_ways=True)
    held.send(b"x" * 70)
    time.sleep(0.7)
    (unacked,) = [s for s in tcp_sockets(socket.AF_INET, (TCP_ESTABLISHED,), {live_port}, info=True)]
    sent_stall = stall_of(unacked)
    destroy(syn)
    aborted = stuck.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    for s in (stuck, held, peer, live):
        s.close()
    return {
        "both": sorted(both), "only_live": only_live, "syn_only": syn_only, "live_port": live_port,
        "listening": live_port in listening, "many_ports": many_ports,
        "syn_stall": (syn_stall.why, syn_stall.age_ms) if syn_stall else None,
        "healthy": (stall_of(healthy), healthy.rtt_ms),
        "sent_stall": (sent_stall.why, sent_stall.age_ms) if sent_stall else None, "aborted": aborted,
    }


@needs_netns
def test_the_kernel_lists_stalled_sockets_by_state_and_port_and_destroys_them():
    seen = run_in_netns(_filtered_and_stalled)
    port = seen["live_port"]
    assert seen["both"] == sorted([(TCP_ESTABLISHED, port), (TCP_SYN_SENT, 9998)])
    assert seen["only_live"] == [(TCP_ESTABLISHED, port)]  # the bytecode kept the other port out
    assert seen["syn_only"] == [(TCP_SYN_SENT, 9998)]  # the state mask kept the established one out
    assert seen["listening"]
    assert seen["many_ports"] == [9998]
    why, age = seen["syn_stall"]
    assert why == "connect" and 200 <= age <= 1000  # 0.3 s into its first 1 s SYN timer
    stall, rtt = seen["healthy"]
    assert stall is None and rtt is not None and rtt < 5
    why, age = seen["sent_stall"]
    assert why == "retransmit" and age >= 200
    assert seen["aborted"] == errno.ECONNABORTED


def test_the_port_filter_jumps_stay_inside_the_kernels_bounds():
    code = port_filter(frozenset({80, 443, 8080}))
    assert len(code) == 36
    # Each port: a test, its port, a jump to the end; the last test's miss leaves the program.
    ops = [(code[i], code[i + 1], int.from_bytes(code[i + 2:i + 4], "little")) for i in range(0, len(code), 4)]
    assert ops[0] == (12, 8, 12) and ops[1] == (0, 0, 80) and ops[2] == (1, 4, 28)
    assert ops[6] == (12, 8, 16) and ops[8] == (1, 4, 4)


def _counters_as_read() -> dict[str, object]:
    activity = TcpActivity()
    first = activity.read()
    fd = activity._fd
    quiet = activity.read()
    refused = socket.socket()
    with contextlib.suppress(ConnectionRefusedError):
        refused.connect(("127.0.0.1", 9))  # nothing listens: a connect begun, refused
    refused.close()
    after = activity.read()
    with open(TcpActivity.PATH) as snmp:  # the file parsed whole, afresh
        names, values = (line.split() for line in snmp if line.startswith("Tcp:"))
    fresh = tuple(int(values[names.index(name)]) for name in ("ActiveOpens", "AttemptFails", "RetransSegs"))
    return {"first": first, "quiet": quiet, "after": after, "fresh": fresh, "same_fd": fd == activity._fd}


@needs_netns
def test_the_tcp_counters_are_read_again_through_the_file_kept_open():
    seen = run_in_netns(_counters_as_read)
    assert seen["first"] is not None and seen["quiet"] == seen["first"]  # a quiet namespace
    opens, failed, retrans = seen["first"]
    assert seen["after"] == (opens + 1, failed + 1, retrans)  # the refused connect, through the same file
    assert seen["after"] == seen["fresh"] and seen["same_fd"]


def _opened_then_answered() -> tuple[bool, bool]:
    """Whether detector.idle() takes a connection for a pooled idle one: just opened, and once
    it has carried a request and its answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    server, _ = listener.accept()

    def client_side() -> DiagSocket:
        (found,) = [s for s in tcp_sockets(socket.AF_INET, (TCP_ESTABLISHED,), {port}, info=True)]
        return found

    opened = idle(client_side())
    client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    server.recv(100)
    server.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    client.recv(100)
    time.sleep(0.05)
    answered = idle(client_side())
    for s in (client, server, listener):
        s.close()
    return opened, answered


@needs_netns
def test_a_connection_just_opened_is_not_taken_for_an_idle_pooled_one():
    assert run_in_netns(_opened_then_answered) == (False, True)
