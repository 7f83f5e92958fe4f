"""Pure parsers about displaced workers: worker generations from `show proc`, `show info` of several
workers, stuck sessions from `show sess`, and live server states from `show servers state`."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from rigs.wholes import known_dead_servers, parse_live_states, steer_entries, summarize_states
from supervisor.haproxy.answers import Proc, ProcList, parse_servers_state, show_info_by_pid
from supervisor.haproxy.config import Config
from supervisor.state import Generation, SuspectServer
from supervisor.steering.dead import live_view
from supervisor.steering.push import stuck_sessions
from supervisor.steering.workers import worker_generations
from tests.support.steering_cases import NEW, OLD, dead_in, digest, live_of, model, steer_map_entries

# ---------------------------------------------------------------- processes and parsers


def test_worker_generations_from_show_proc_and_state():
    procs = ProcList(
        Proc(1, "master", 0), 0, (Proc(30, "worker", 0),), (Proc(20, "worker", 1), Proc(10, "worker", 2)),
    )
    now = datetime.now(UTC)
    generations = {n: Generation(n, Config.parse(""), "e", "r", now, pid) for n, pid in ((2, 20), (3, 30))}
    assert worker_generations(procs, generations) == {30: 3, 20: 2, 10: None}


def test_split_show_info_of_several_workers():
    text = "Name: HAProxy\nVersion: 2.6.12\nPid: 11\nCurrConns: 3\n\nName: HAProxy\nPid: 12\nCurrConns: 0\n"
    info = show_info_by_pid(text)
    assert info[11]["CurrConns"] == "3" and info[12]["CurrConns"] == "0"


# Captured from HAProxy 2.6.12 (`@!<old pid> show sess`): a stream connecting to a vanished
# server (scb state 5 = CON), one queued in a backend (2 = QUE, no server yet), one established
# (8 = EST), and the CLI's own stream.
SHOW_SESS = (Path(__file__).parent / "captured" / "show_sess_2.6.12.txt").read_text()


def test_stuck_sessions_are_those_still_reaching_a_dead_server():
    assert stuck_sessions(SHOW_SESS, frozenset({"app/r1", "q/s1"})) == ["0x561656a409b0"]
    assert stuck_sessions(SHOW_SESS, frozenset({"app/r3"})) == []
    # From one frontend only (the detector's rescue takes the hand-off frontend's).
    assert stuck_sessions(SHOW_SESS, frozenset({"app/r1"}), frontend="fe") == ["0x561656a409b0"]
    assert stuck_sessions(SHOW_SESS, frozenset({"app/r1"}), frontend="_hs_handoff") == []


# ---------------------------------------------------------------- live states

# Captured from HAProxy 2.6.12 just after a worker started: `up` passed its first check
# (check result 3), `dead` (a closed port) has not been checked yet (result 0, check state
# 6 = configured|enabled) and `nocheck` has no check (state 0) at the same address.
SERVERS_STATE = (Path(__file__).parent / "captured" / "servers_state_2.6.12.txt").read_text()


def test_parse_live_states_treats_unchecked_servers_as_no_evidence():
    live = parse_live_states(SERVERS_STATE.replace("2 app 3 nocheck", "#"))
    assert live.pending == {"app 127.0.0.1:43157"} and live.down == frozenset()
    assert live.alive_by_key == {"app/dead": None}  # plainly alive servers are not listed
    # a server without check at the same address is evidence that it is alive
    assert parse_live_states(SERVERS_STATE).pending == frozenset()


def test_parse_live_states_down_and_maint():
    down = SERVERS_STATE.replace("2 app 1 up 127.0.0.1 2 0", "2 app 1 up 127.0.0.1 0 0")
    assert parse_live_states(down).down == {"app 127.0.0.1:35137"}
    maint = SERVERS_STATE.replace("2 app 1 up 127.0.0.1 2 0", "2 app 1 up 127.0.0.1 2 1")
    assert parse_live_states(maint).alive_by_key["app/up"] is False
    drain = SERVERS_STATE.replace("2 app 1 up 127.0.0.1 2 0", "2 app 1 up 127.0.0.1 2 8")
    assert "app/up" not in parse_live_states(drain).alive_by_key  # draining is alive


def test_parse_live_states_agrees_with_the_plain_parser_on_op_and_admin_states():
    rows = [("0", "0"), ("2", "0"), ("2", "1"), ("1", "0"), ("3", "4"), ("2", "8"), ("2", "32"), ("0", "8")]
    lines = SERVERS_STATE.splitlines()[:2]
    for i, (op, admin) in enumerate(rows):
        lines.append(f"2 b{i % 3} {i} s{i} 10.0.0.{i} {op} {admin} 1 1 0 6 3 4 6 0 0 0 - 80 - 0 0 - - 0")
    text = "\n".join(lines) + "\n"
    fast = parse_live_states(text)
    plain = summarize_states(parse_servers_state(text))
    assert fast.down == plain.down and fast.pending == plain.pending == frozenset()
    assert {k for k, v in fast.alive_by_key.items() if v is False} == {
        k for k, v in plain.alive_by_key.items() if v is False
    }


def test_a_dead_endpoint_stays_dead_until_the_new_worker_has_checked_it():
    text = "backend app\n  server up 127.0.0.1:35137 check\n  server dead 127.0.0.1:43157 check\n"
    cfg = digest(model(text))
    fresh = parse_live_states(SERVERS_STATE.replace("2 app 3 nocheck", "#"))
    was_down = frozenset({"app 127.0.0.1:43157"})
    assert dead_in(cfg, cfg, live_view(cfg, fresh, (), was_down)) == {"app/dead"}
    assert dead_in(cfg, cfg, live_view(cfg, fresh, ())) == frozenset()  # never seen down: no evidence


def test_digest_based_decisions_match_the_plain_ones():
    old, new = model(OLD), model(NEW)
    live = live_of(NEW, down={"wide/wide_r2"})
    view = live_view(digest(new), summarize_states(live), {"echo/fallback"})
    assert dead_in(digest(old), digest(new), view) == known_dead_servers(old, new, live, {"echo/fallback"})
    dead = dead_in(digest(old), digest(new), view)
    assert steer_entries(digest(old), dead, "fail-fast") == steer_map_entries(old, dead, "fail-fast")


@pytest.mark.parametrize(("left_in", "dead"), [(False, {"app/dead"}), (True, set())])
def test_a_suspect_steers_old_workers_off_it_unless_the_current_worker_keeps_it(left_in: bool, dead: set[str]):
    text = "backend app\n  server up 127.0.0.1:35137 check\n  server dead 127.0.0.1:43157 check\n"
    cfg = digest(model(text))
    suspect = SuspectServer("app/dead", "127.0.0.1:43157", "connect", datetime(2025, 1, 1, tzinfo=UTC), left_in)
    assert dead_in(cfg, cfg, live_view(cfg, parse_live_states(""), (), suspects=[suspect])) == dead
