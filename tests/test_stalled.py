"""The detector's decision, sockets in, suspect servers out: tables of kernel views."""

from __future__ import annotations

import pytest

from supervisor.master.sockdiag import TCP_ESTABLISHED, TCP_SYN_SENT, DiagSocket, TcpCounters
from supervisor.steering.detector import idle, left_in, nothing_to_dump, stall_of, suspects, threshold_ms, to_abort


def sock(state: int = TCP_SYN_SENT, timer: int = 1, retrans: int = 0, expires: int = 0, wqueue: int = 0,
         rto: float | None = None, port: int = 8001, address: str = "10.0.0.1", rqueue: int = 0,
         sent_ago: int | None = None, received_ago: int | None = None, inode: int = 7,
         data_in: int | None = None) -> DiagSocket:
    sockid = f"{address}:{port}:{state}:{timer}:{retrans}:{expires}:{inode}".encode()
    return DiagSocket(2, state, "127.0.0.1", 40000, address, port, sockid, timer, retrans, expires, rqueue, wqueue,
                      inode,
                      rto_ms=rto, sent_ago_ms=sent_ago, received_ago_ms=received_ago, data_segs_in=data_in)


@pytest.mark.parametrize(("socket", "why", "age_ms"), [
    # a connect 300 ms into its first 1 s SYN timer
    (sock(rto=1000, expires=700), "connect", 300),
    # a connect already retransmitted once: the 1 s before, and 500 ms into the 2 s interval
    (sock(rto=2000, expires=1500, retrans=1), "connect", 500 + 1000),
    # without tcp_info: the SYN timer's 1 s
    (sock(expires=900), "connect", 100),
    # established, 70 bytes unacknowledged, retransmitted once, 100 ms into a 400 ms RTO
    (sock(TCP_ESTABLISHED, retrans=1, wqueue=70, rto=400, expires=300), "retransmit", 100 + 200),
    # established with data in flight but not retransmitted yet: no stall (an ordinary send)
    (sock(TCP_ESTABLISHED, retrans=0, wqueue=70, rto=204, expires=100), None, None),
    # established, retransmitting but nothing queued: nothing waits on it
    (sock(TCP_ESTABLISHED, retrans=1, wqueue=0, rto=400), None, None),
    # a zero-window probe (timer 4): a live server that reads slowly, not a vanished one
    (sock(TCP_ESTABLISHED, timer=4, retrans=3, wqueue=70, rto=400), None, None),
    # an idle pooled connection: no timer
    (sock(TCP_ESTABLISHED, timer=0), None, None),
])
def test_which_sockets_are_stalled_and_since_when(socket: DiagSocket, why: str | None, age_ms: float | None):
    stall = stall_of(socket)
    assert (stall.why if stall else None) == why
    if stall is not None:
        assert stall.age_ms == pytest.approx(age_ms)
        assert stall.endpoint == ("10.0.0.1", 8001)


def test_first_sight_counts_when_the_timer_says_less():
    stall = stall_of(sock(rto=1000, expires=990), first_seen_ago_ms=450)
    assert stall is not None and stall.age_ms == 450


@pytest.mark.parametrize(("rtts", "floor", "expected"), [
    ((), 200, 200),  # nothing seen: the floor
    ((0.01,), 200, 200),  # loopback
    ((80.0,), 200, 640),  # a WAN server at 80 ms: eight round trips
    ((10.0, 40.0), 200, 320),  # the slowest counts
    ((10.0,), 500, 500),  # a floor set higher
])
def test_the_threshold_follows_the_round_trips(rtts: tuple[float, ...], floor: float, expected: float):
    assert threshold_ms(rtts, floor) == expected


SERVERS = {("10.0.0.1", 8001): ("be/r1", "other/r1"), ("10.0.0.2", 8001): ("be/r2",)}


@pytest.mark.parametrize(("sockets", "rtts", "expected"), [
    # one stalled connect past the floor: both servers at that endpoint
    ([sock(rto=1000, expires=600)], {}, {"be/r1": "connect", "other/r1": "connect"}),
    # under the floor: nothing yet
    ([sock(rto=1000, expires=900)], {}, {}),
    # past the floor but the server is 80 ms away: 640 ms needed
    ([sock(rto=1000, expires=600)], {("10.0.0.1", 8001): 80.0}, {}),
    ([sock(rto=2000, expires=1500, retrans=1)], {("10.0.0.1", 8001): 80.0},
     {"be/r1": "connect", "other/r1": "connect"}),
    # a socket toward something that is no server of the config
    ([sock(rto=1000, expires=100, address="10.9.9.9")], {}, {}),
    # a retransmitting established connection to r2
    ([sock(TCP_ESTABLISHED, retrans=2, wqueue=70, rto=800, expires=100, address="10.0.0.2")], {},
     {"be/r2": "retransmit"}),
    # healthy sockets only
    ([sock(TCP_ESTABLISHED, timer=0), sock(TCP_ESTABLISHED, timer=0, address="10.0.0.2")], {}, {}),
])
def test_suspect_servers(sockets: list[DiagSocket], rtts: dict, expected: dict[str, str]):
    stalls = [s for s in map(stall_of, sockets) if s is not None]
    found = suspects(stalls, SERVERS, rtts, 200, now=1000.0)
    assert {k: s.why for k, s in found.items()} == expected


def test_since_is_the_oldest_stall():
    stalls = [stall_of(sock(rto=1000, expires=700)), stall_of(sock(rto=2000, expires=1000, retrans=1))]
    found = suspects([s for s in stalls if s], SERVERS, {}, 200, now=1000.0)
    assert found["be/r1"].since == pytest.approx(1000.0 - 2.0)


@pytest.mark.parametrize(("socket", "expected"), [
    (sock(TCP_ESTABLISHED, timer=0), True),
    (sock(TCP_ESTABLISHED, timer=0, sent_ago=36_000, received_ago=35_990), True),  # answered, then idle
    (sock(TCP_ESTABLISHED, timer=0, sent_ago=36_000, received_ago=35_990, data_in=1), True),
    # just opened: the last thing in was the SYN-ACK, and no request has gone out on it yet
    (sock(TCP_ESTABLISHED, timer=0, sent_ago=4_100, received_ago=2, data_in=0), False),
    (sock(TCP_ESTABLISHED, timer=0, sent_ago=300, received_ago=36_000), False),  # a request awaits its answer
    (sock(TCP_ESTABLISHED, timer=0, rqueue=5), False),  # an answer not read yet
    (sock(TCP_ESTABLISHED, retrans=1, wqueue=70), False),  # a request in flight
    (sock(), False),
])
def test_idle_pooled_connections(socket: DiagSocket, expected: bool):
    assert idle(socket) is expected


BACKENDS = {"a": ("a/r1", "a/r2", "a/fallback"), "b": ("b/r1",), "c": ("c/r1", "c/r2")}


@pytest.mark.parametrize(("suspect", "dead", "expected"), [
    ({"a/r1"}, set(), set()),  # r2 and the backup still route
    ({"a/r1", "a/r2"}, set(), set()),  # the backup routes
    ({"a/r1", "a/r2"}, {"a/fallback"}, {"a/r1", "a/r2"}),  # nothing else: all kept, as HAProxy has them
    ({"a/r1"}, {"a/r2", "a/fallback"}, {"a/r1"}),
    ({"b/r1"}, set(), {"b/r1"}),  # the only server
    ({"b/r1", "c/r1"}, set(), {"b/r1"}),  # per backend
    ({"c/r1", "c/r2"}, set(), {"c/r1", "c/r2"}),
    ({"x/r1"}, set(), {"x/r1"}),  # a backend the config does not list: nothing known to route to
])
def test_the_suspects_a_backend_keeps(suspect: set[str], dead: set[str], expected: set[str]):
    assert left_in(suspect, BACKENDS, dead) == expected


# Two workers: 100 is current, 200 old. Inodes: 1x the current worker's sockets, 2x the old one's,
# 99 another process's. r1 at 10.0.0.1 (also `other/r1` in the current config), r2 at 10.0.0.2.
CURRENT, OLD = 100, 200
OWNERS = {11: CURRENT, 21: OLD, 22: OLD, 23: OLD}
KEYS_AT = {("10.0.0.1", 8001): ("be/r1", "other/r1"), ("10.0.0.2", 8001): ("be/r2",),
           ("10.0.0.3", 8001): ("be/r3",)}
OLD_OWN = {OLD: {("10.0.0.1", 8001): ("be/r1",), ("10.0.0.2", 8001): ("be/r2",),
                 ("10.0.0.3", 8001): ("be/r3", "shared/r3")}}
R1, R2, R3 = "10.0.0.1", "10.0.0.2", "10.0.0.3"
FRESH = {"rto": 1000, "expires": 990}  # a connect 10 ms old: under every threshold


@pytest.mark.parametrize(("sockets", "held", "steered", "dead", "expected"), [
    # a held suspect: in the current worker at once, in the old one once steered off it
    ([sock(inode=11, **FRESH), sock(inode=21, **FRESH)], {"be/r1", "other/r1"}, {OLD: {"be/r1"}}, set(),
     [(11, "suspect"), (21, "suspect")]),
    ([sock(inode=21, **FRESH)], {"be/r1", "other/r1"}, {OLD: set()}, set(), []),
    # another process's socket, or one toward no server: left alone
    ([sock(inode=99, **FRESH), sock(inode=21, address="10.9.9.9", **FRESH)], {"be/r1"}, {OLD: {"be/r1"}}, set(), []),
    # known dead and steered off in the old worker: its connect at first sight (a retry met a second dead server)
    ([sock(inode=21, **FRESH), sock(inode=22, address=R2, **FRESH)], set(), {OLD: {"be/r1", "be/r2"}},
     {"be/r1", "be/r2"}, [(21, "dead"), (22, "dead")]),
    # known dead but not steered off yet (the push is under way): kept
    ([sock(inode=22, address=R2, **FRESH)], set(), {OLD: set()}, {"be/r2"}, []),
    # steered off (an older push) but no longer known dead (it came back): kept
    ([sock(inode=22, address=R2, **FRESH)], set(), {OLD: {"be/r2"}}, set(), []),
    # the current worker's connect to a known-dead server is not this rule's (its checks see it DOWN)
    ([sock(inode=11, **FRESH)], set(), {OLD: {"be/r1"}}, {"be/r1"}, []),
    # an established connection retransmitting to a known-dead server: only a suspect's is destroyed
    ([sock(TCP_ESTABLISHED, retrans=1, wqueue=70, rto=400, expires=300, inode=21)], set(), {OLD: {"be/r1"}},
     {"be/r1"}, []),
    # another backend of the old worker's config still routes to the endpoint: its connects are kept
    ([sock(inode=23, address=R3, **FRESH)], set(), {OLD: {"be/r3"}}, {"be/r3"}, []),
    ([sock(inode=23, address=R3, **FRESH)], set(), {OLD: {"be/r3", "shared/r3"}}, {"be/r3", "shared/r3"},
     [(23, "dead")]),
])
def test_which_stalled_sockets_are_destroyed(sockets, held, steered, dead, expected):
    stalls = [s for s in map(stall_of, sockets) if s is not None]
    found = to_abort(stalls, OWNERS, KEYS_AT, frozenset(held), CURRENT,
                     {pid: frozenset(k) for pid, k in steered.items()}, OLD_OWN, frozenset(dead))
    assert [(stall.socket.inode, why) for stall, why in found] == expected


def test_an_old_worker_whose_config_is_unknown_gets_no_known_dead_abort():
    stalls = [s for s in [stall_of(sock(inode=21, **FRESH))] if s is not None]
    assert to_abort(stalls, OWNERS, KEYS_AT, frozenset(), CURRENT, {OLD: frozenset({"be/r1"})}, {},
                    frozenset({"be/r1"})) == []


def test_the_suspects_the_current_worker_keeps_keep_their_sockets():
    stalls = [s for s in [stall_of(sock(inode=11, **FRESH)), stall_of(sock(inode=21, **FRESH))] if s is not None]
    held = frozenset({"be/r1", "other/r1"})
    steered = {OLD: frozenset({"be/r1"})}
    kept = to_abort(stalls, OWNERS, KEYS_AT, held, CURRENT, steered, OLD_OWN, frozenset(), held)
    assert [(stall.socket.inode, why) for stall, why in kept] == [(21, "suspect")]  # the old worker steers off it
    one_kept = to_abort(stalls, OWNERS, KEYS_AT, held, CURRENT, steered, OLD_OWN, frozenset(), {"other/r1"})
    assert [(stall.socket.inode, why) for stall, why in one_kept] == [(11, "suspect"), (21, "suspect")]


BASE = TcpCounters(opens=100, failed=40, retrans=7)


@pytest.mark.parametrize(("now", "expected"), [
    (BASE, True),  # nothing happened
    (TcpCounters(105, 45, 7), True),  # five connects, each refused: nothing can be pending
    (TcpCounters(105, 44, 7), False),  # one connect not failed: pending, or established
    (TcpCounters(100, 40, 8), False),  # a segment retransmitted
    (TcpCounters(100, 41, 7), False),  # a failed accepted handshake alone: not a connect's
    (None, False),  # the counters unreadable
])
def test_when_the_counters_leave_nothing_to_dump(now: TcpCounters | None, expected: bool):
    assert nothing_to_dump(BASE, now) is expected
    assert nothing_to_dump(None, now) is False  # no dump yet to compare with
