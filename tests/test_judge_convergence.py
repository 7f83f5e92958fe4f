"""judge_convergence: converged or why not, passing or not, and when to retry, as a table
(no HAProxy). It is the one place these are decided: a failure HAProxy refused is not
retried, one that may pass is retried with backoff."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.reloader.decisions import Attempt, Facts, Judgement, judge_convergence, runs_goal
from supervisor.state import ReloadRecord, utcnow

SOCKET = "/run/haproxy-supervisor/master.sock"
# Up, reachable, nothing pending, the goal runs: converged.
UP = Facts(master_up=True, master_socket_ok=True, unconfirmed=False, change_pending=False, runs_goal=True,
           converged=False, retry_set=False, master_socket=SOCKET)


def attempt(result: str, error: str | None = None, refused: bool = False) -> Attempt:
    return Attempt(ReloadRecord(utcnow(), result, 1.0, error), refused)  # type: ignore[arg-type]


OFF = replace(UP, runs_goal=False)
TABLE = [
    ("converged", UP, Judgement(True)),
    ("converged after an ok reload", replace(UP, attempt=attempt("ok")), Judgement(True)),
    ("converged whatever the master socket was", replace(UP, converged=True), Judgement(True)),
    ("master down", replace(UP, master_up=False), Judgement(False, "the HAProxy master is not running")),
    ("socket gone", replace(UP, master_socket_ok=False), Judgement(False, f"{SOCKET} is missing")),
    ("unconfirmed", replace(UP, unconfirmed=True),
     Judgement(False, "HAProxy has not confirmed the last reload yet")),
    ("a change pending, was converged", replace(UP, change_pending=True, converged=True),
     Judgement(False, "a change is pending")),
    ("a change pending, reason known already", replace(UP, change_pending=True), Judgement(False, None)),
    ("not the goal, was converged", replace(OFF, converged=True),
     Judgement(False, "the current worker does not run the rendered config")),
    ("not the goal after a skip", replace(OFF, attempt=attempt("skipped_unchanged")),
     Judgement(False, "the current worker does not run the rendered config")),
    ("invalid: not passing, not retried", replace(OFF, attempt=attempt("invalid", "[ALERT] bad\nmore")),
     Judgement(False, "the rendered config is invalid: [ALERT] bad", transient=False, retry="stop")),
    ("invalid, even with the goal running", replace(UP, change_pending=True, attempt=attempt("invalid", "x")),
     Judgement(False, "the rendered config is invalid: x", transient=False, retry="stop")),
    ("refused: not passing, not retried", replace(OFF, attempt=attempt("failed", "port in use", refused=True)),
     Judgement(False, "HAProxy refused the new config: port in use", transient=False, retry="stop")),
    ("failed: passing, backoff", replace(OFF, attempt=attempt("failed", "show proc: no answer")),
     Judgement(False, "reload failed: show proc: no answer", retry="backoff")),
    ("unknown: passing, backoff", replace(OFF, attempt=attempt("unknown", "no new worker")),
     Judgement(False, "reload unknown: no new worker", retry="backoff")),
    ("failed with a retry set: left", replace(OFF, retry_set=True, attempt=attempt("failed", "e")),
     Judgement(False, "reload failed: e", retry="leave")),
    ("refused with the master down: stopped all the same",
     replace(OFF, master_up=False, attempt=attempt("failed", "e", refused=True)),
     Judgement(False, "the HAProxy master is not running", retry="stop")),
    ("failed with the master down: the master first, backoff",
     replace(OFF, master_up=False, attempt=attempt("failed", "e")),
     Judgement(False, "the HAProxy master is not running", retry="backoff")),
    ("between attempts, nothing new", OFF, Judgement(False, None)),
]


@pytest.mark.parametrize(("facts", "judgement"), [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_judge_convergence(facts: Facts, judgement: Judgement):
    assert judge_convergence(facts) == judgement


def test_runs_goal_wants_both_known_and_equal():
    assert runs_goal(("a", "i"), ("a", "i"))
    assert not runs_goal(("a", "i"), ("a", None))
    assert not runs_goal(None, ("a", "i")) and not runs_goal(("a", "i"), None)
