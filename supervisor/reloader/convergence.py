"""Does the node run the rendered config? If not, why not, is that passing, and when to try
again: judged from the facts the reloader holds, by one pure function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..state import ReloadRecord, ReloadResult
from .problems import one_line

# leave: the schedule stays as it is; stop: no attempt until the config changes or a reload is
# asked for; backoff: the next attempt after retry_delay (schedule.py).
Retry = Literal["leave", "stop", "backoff"]


def runs_goal(goal: tuple[str, str | None] | None, current: tuple[str, str | None] | None) -> bool:
    """Does the current worker run the goal? Both are (effective sha256, watched files' digest)."""
    return goal is not None and current is not None and goal == current


@dataclass(frozen=True)
class Attempt:
    """One attempt to converge, as its outcome is judged: its record, and whether HAProxy
    refused the config (could not load it), which is no passing failure."""

    record: ReloadRecord
    refused: bool = False


@dataclass(frozen=True)
class Facts:
    """What the judgement goes by, gathered by the reloader when an attempt ends and between them."""

    master_up: bool
    master_socket_ok: bool
    unconfirmed: bool  # a reload HAProxy has not confirmed yet
    change_pending: bool  # the scheduler holds a change, a request or a retry
    runs_goal: bool
    converged: bool  # as published before this judgement
    retry_set: bool  # a retry is scheduled already
    attempt: Attempt | None = None  # the attempt just made; None between attempts
    master_socket: str = "the master socket"


@dataclass(frozen=True)
class Judgement:
    converged: bool
    reason: str | None = None  # None while not converged: nothing new, the published reason stands
    transient: bool = True  # a passing failure: retried, and /readyz says 503 once it lasts
    retry: Retry = "leave"


def judge_convergence(facts: Facts) -> Judgement:
    """Converged when the master is up and reachable, nothing is unconfirmed or pending, and the
    current worker runs the goal. Otherwise why not, whether that passes, and when to retry:
    an invalid config or one HAProxy refused is not retried by itself (HAProxy serves the last
    good config, and while it tries a config (2.6: "Paused frontend") the serving worker's
    listeners accept nothing); a failed or unconfirmed reload is, with backoff."""
    if (
        facts.master_up and facts.master_socket_ok and not facts.unconfirmed
        and not facts.change_pending and facts.runs_goal
    ):
        return Judgement(True)
    attempt = facts.attempt
    result: ReloadResult | None = attempt.record.result if attempt else None
    error = one_line(attempt.record.error or "", 200) if attempt else ""
    refused = attempt is not None and attempt.refused
    if result == "invalid":
        return Judgement(False, f"the rendered config is invalid: {error}", transient=False, retry="stop")
    reason: str | None = None
    transient = True
    if not facts.master_up:
        reason = "the HAProxy master is not running"
    elif not facts.master_socket_ok:
        reason = f"{facts.master_socket} is missing"
    elif result in ("failed", "unknown"):
        reason = f"HAProxy refused the new config: {error}" if refused else f"reload {result}: {error}"
        transient = not refused
    elif facts.unconfirmed:
        reason = "HAProxy has not confirmed the last reload yet"
    elif facts.converged or attempt is not None:
        why = "the current worker does not run the rendered config"
        reason = "a change is pending" if facts.change_pending else why
    retry: Retry = "leave"
    if refused and result == "failed":
        retry = "stop"
    elif result in ("failed", "unknown") and not facts.retry_set:
        retry = "backoff"
    return Judgement(False, reason, transient, retry)
