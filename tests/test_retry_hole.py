"""Where a steered old worker's connect retries go (bench/retry_hole.py), in a network namespace
of its own with nftables: the logic of its table, and the control that reproduces today's slow
retry on the suite's binary."""

from __future__ import annotations

import shutil

import pytest

from bench.retry_hole import CONNECT_TIMEOUT_MS, RETRIES, SHAPES, backend_name, rows_of, run, summary


def logged(be: str, retries: int, ta_ms: int, status: int = 200) -> dict:
    return {"pid": 7, "backend": be, "request": "GET /x?w=1&c=0 HTTP/1.1", "retries": retries, "Ta": ta_ms,
            "status": status}


def test_rows_count_retries_that_went_back_to_a_dead_server():
    be = backend_name("leastconn", "every")
    found = {"version": "2.6.12", "old_worker": 7, "log": [
        logged(be, 1, CONNECT_TIMEOUT_MS + 5),  # one timeout, then a live server
        logged(be, 2, 2 * CONNECT_TIMEOUT_MS + 5),  # back to a dead one
        logged(be, RETRIES, (RETRIES + 1) * CONNECT_TIMEOUT_MS, 503),
        logged(be, 0, 3),  # straight to the live server
        {**logged(be, 1, CONNECT_TIMEOUT_MS), "pid": 8},  # the current worker's: not counted
    ], "answers": {w: {backend_name(b, r): [(200, 0.01)] for b in ("leastconn", "roundrobin", "random")
                       for r in ("none", "last", "every")} for w in ("1", "2")}}
    found["answers"]["1"][be] = [(200, 2.0), (200, 4.0), (503, 8.0), (200, 0.01)]
    row = next(r for r in rows_of(found, "two of three dead") if (r.balance, r.redispatch) == ("leastconn", "every"))
    assert (row.first_dead, row.back_to_dead, row.failed, row.worst_s, row.requests) == (3, 2, 1, 8.0, 4)
    assert "| two of three dead | option redispatch 1 | 2 of 3, 1 failed, 8.0 s |" in summary([row])


def test_abort_rows_count_a_retry_to_a_dead_server_by_its_retries():
    be = backend_name("roundrobin", "abort")
    found = {"version": "3.0.11", "old_worker": 7, "keys": ["abort"], "log": [
        logged(be, 1, 310),  # aborted once, then the live server
        logged(be, 2, 420),  # aborted, a retry to the other dead one, aborted again
        logged(be, 0, 2),
    ], "answers": {w: {backend_name(b, "abort"): [(200, 0.01)] for b in ("leastconn", "roundrobin", "random")}
                   for w in ("1", "2")}}
    found["answers"]["1"][be] = [(200, 0.31), (200, 0.42), (200, 0.01)]
    rows = rows_of(found, "two of three dead")
    assert {r.redispatch for r in rows} == {"abort"}
    row = next(r for r in rows if r.balance == "roundrobin")
    assert (row.first_dead, row.back_to_dead, row.failed, row.worst_s) == (2, 1, 0, 0.42)
    assert "| two of three dead | option redispatch 1 + abort | 1 of 2, 0 failed, 0.4 s |" in summary([row])


@pytest.mark.skipif(not (shutil.which("unshare") and (shutil.which("nft") or shutil.which("/usr/sbin/nft"))),
                    reason="needs unshare and nftables")
def test_control_a_steered_request_to_a_vanished_server_waits_for_its_last_retry():
    """Control (HAProxy alone, every binary): `use-server` makes the request direct, so with
    `option redispatch` it retries its dead target until the last retry; with `option redispatch 1`
    it leaves after one timeout; with neither it fails after every retry. With the detector's abort
    (`option redispatch 1`), it leaves at the first poll once the worker is steered."""
    from rigs.harness import haproxy_binary

    assert "steered to r1, then r1 dead" in SHAPES
    rows = {(r.balance, r.redispatch): r for r in run([haproxy_binary()], ["steered to r1, then r1 dead"])}
    timeout = CONNECT_TIMEOUT_MS / 1000
    for balance in ("leastconn", "roundrobin", "random"):
        last, every, none = rows[balance, "last"], rows[balance, "every"], rows[balance, "none"]
        assert last.failed == 0 and last.worst_s >= RETRIES * timeout - 0.1, last
        assert every.failed == 0 and every.back_to_dead == 0 and every.worst_s < 2 * timeout, every
        assert none.failed == none.requests, none
        aborted = rows[balance, "abort"]
        assert aborted.failed == 0 and aborted.first_dead > 0 and aborted.worst_s < timeout / 2, aborted
        assert max(r.steered_worst_s for r in (last, every, none)) < timeout, "a request after the push waited"
