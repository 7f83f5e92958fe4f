"""The stalled-connection detector end to end: the daemon, real HAProxy, real servers, in a
network namespace of the test's own, one server black-holed or partitioned by nftables.
Requests on held connections go to an old worker (its pooled connections to the server
included: `http-reuse always`, no `timeout server`), new ones to the current worker."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

from rigs.netns import needs_netns, run_in_netns
from rigs.vanish import Outcome, run_staged, staged_status

pytestmark = needs_netns

# What ended a request: the detector's abort, well before the `timeout connect 5s` or the
# control's 30 s hang. How fast is a figure for bench.drain --vanish, not a timed test.
NOT_WAITED_OUT_S = 3.0


def _figures(outcome: Outcome) -> str:
    return f"held {outcome.figures('held')} {outcome.held}\nnew {outcome.figures('new')} {outcome.new}"


def test_a_black_holed_server_is_steered_off_in_every_worker_at_once():
    outcome = run_in_netns(run_staged, detector=True, timeout=120)
    for mode in ("held", "new"):
        failed, _, worst = outcome.figures(mode)
        assert failed == 0 and worst < NOT_WAITED_OUT_S, _figures(outcome)
    assert outcome.suspects == ["app/r2"]


def test_a_partitioned_server_under_pooling_fails_and_hangs_no_request():
    outcome = run_in_netns(run_staged, detector=True, partition=True, timeout=120)
    for mode in ("held", "new"):
        failed, _, worst = outcome.figures(mode)
        assert failed == 0 and worst < NOT_WAITED_OUT_S, _figures(outcome)


def test_control_without_the_detector_a_pooled_connection_to_a_partitioned_server_hangs():
    """Today's behaviour: an old worker's request on its pooled idle connection to the server
    waits for TCP's retransmissions (no `timeout server`), until the client gives up."""
    outcome = run_in_netns(run_staged, detector=False, partition=True, requests=4, timeout=180)
    failed, slow, worst = outcome.figures("held")
    assert failed + slow >= 1 and worst >= 5.0, _figures(outcome)
    assert outcome.suspects == []


# Without the abort (no CAP_NET_ADMIN), an old worker that hands off: Ray's `retry-on
# conn-failure`, no pooling (a request sent on a pooled connection only the abort can end).
NO_ABORT = {"detector": {"abort": False}, "old_workers": {"guard": True, "hand_off": True}}
SENT_BACK = "handed-off requests connecting to suspects"


def test_without_the_abort_a_handed_off_request_stuck_connecting_is_sent_again():
    """The current worker balances the held connections' requests over r1 and r2; those whose
    connect to r2 stalls are ended there and sent again by their old worker."""
    outcome = run_in_netns(run_staged, detector=True, settings=NO_ABORT, fresh_requests=False,
                           retry_on="conn-failure", reuse="never", timeout=120)
    failed, _, worst = outcome.figures("held")
    assert failed == 0 and worst < NOT_WAITED_OUT_S, _figures(outcome)
    assert SENT_BACK in outcome.daemon_log
    assert outcome.suspects == ["app/r2"]


def test_control_with_retry_on_none_a_handed_off_request_stuck_connecting_fails():
    """The old worker's retry is what saves it: with `retry-on none` the same request fails."""
    outcome = run_in_netns(run_staged, detector=True, settings=NO_ABORT, fresh_requests=False,
                           retry_on="none", reuse="never", timeout=120)
    failed, _, _ = outcome.figures("held")
    assert failed >= 1, _figures(outcome)
    assert SENT_BACK in outcome.daemon_log


def test_a_suspect_that_comes_back_is_routed_again_within_rise_checks_and_by_old_workers():
    # `inter 500ms rise 2`: two passing checks after the drop is lifted. An old worker runs no
    # checks: it routes to r2 again once the detector lets the suspect go (`hold_s`) and the
    # steering takes r2 out of its down set. While r2 was gone it answered from r1 only.
    outcome = run_in_netns(
        run_staged, detector=True, requests=3, inter="500ms", lift=True, held_after_lift=4,
        settings={"detector": {"enabled": True, "hold_s": 1}}, timeout=120,
    )
    assert outcome.suspects == ["app/r2"]
    assert outcome.back_after_s is not None and outcome.back_after_s < 2.5, outcome
    assert all(status == 200 and body == "r1" for status, body, _ in outcome.held), outcome.held
    after = outcome.held_after_lift
    assert len(after) == 4 and all(status == 200 for status, _, _ in after), after
    assert "r2" in {body for _, body, _ in after}, (after, outcome.daemon_log[-3000:])


class LateServer:
    """A live HTTP server on loopback whose application starts accepting `after_s` late, with
    an accept queue of `backlog`; each connection is answered in a thread of its own, so one
    whose request is still being retransmitted (its handshake completed late) holds up no other."""

    def __init__(self, backlog: int, after_s: float) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(backlog)
        self.port = self.listener.getsockname()[1]
        self.after_s = after_s
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        time.sleep(self.after_s)
        self.listener.settimeout(10)
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(15)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\nlate")

    def close(self) -> None:
        self.listener.close()


def _slow_accepting() -> dict[str, object]:
    """A live server that accepts late: its kernel completes the handshakes and acknowledges
    the requests, the application reads them 1.5 s later. Slow, not stalled."""
    server = LateServer(backlog=64, after_s=1.5)
    try:
        return asyncio.run(staged_status(server.port, requests=3, wait_s=1.0))
    finally:
        server.close()


def test_a_live_server_that_accepts_slowly_is_no_false_alarm():
    seen = run_in_netns(_slow_accepting, timeout=120)
    assert seen["suspects_while_waiting"] == [], seen
    assert seen["statuses"] == [200, 200, 200], seen


def _full_syn_backlog() -> dict[str, object]:
    """A live server whose accept queue is full for 4.5 s: its kernel drops new SYNs, so
    connects to it stall in SYN-SENT exactly as toward a vanished node, until the application
    accepts again and a connect gets through (`timeout connect 5s`, then a retry). It is the
    backend's only server: aborting its connects, retried after a turn-around of 1 s each,
    spends HAProxy's 3 retries before it accepts, and a slow 200 becomes a 503."""
    server = LateServer(backlog=0, after_s=4.5)
    filler = socket.create_connection(("127.0.0.1", server.port))
    filler.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    try:
        return asyncio.run(staged_status(server.port, requests=6, wait_s=1.0))
    finally:
        filler.close()
        server.close()


def test_the_last_server_of_a_backend_with_a_full_syn_backlog_is_left_in():
    seen = run_in_netns(_full_syn_backlog, timeout=120)
    assert seen["statuses"] == [200] * 6, seen
