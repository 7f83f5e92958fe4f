"""The reloader's decisions, pure: when the next cycle is due; skip, runtime apply or reload; did
a reload take; converged or why not, and when to retry; how trouble is worded on one line."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Literal

from ..haproxy.answers import ProcList
from ..haproxy.config import Config
from ..haproxy.runtime.plan import transient_render
from ..state import ReloadRecord, ReloadResult


def one_line(text: str, limit: int = 400) -> str:
    """HAProxy's message on one log line: its ALERT lines first, joined with ` | `."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    alerts = [ln for ln in lines if "ALERT" in ln] or lines
    joined = " | ".join(alerts)
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


# Errors of the disk, not of the daemon: one log line each, no traceback.
EXPECTED_IO_ERRORS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO,
    errno.EMFILE, errno.ENFILE,
})


def io_error_line(exc: OSError) -> str:
    """`<file>: <strerror>`, the way the shell says it."""
    what = exc.strerror or str(exc)
    return f"{exc.filename}: {what}" if exc.filename else what


Cause = Literal["forced", "asked", "change", "retry"]


@dataclass
class ReloadScheduler:
    """When the next cycle is due, and why (monotonic). A change: `debounce_s` after a burst's last
    write, at most `max_delay_s` after its first; none before `min_interval_s` after the previous
    reload. Whatever is pending when one is due coalesces into it."""

    debounce_s: float
    min_interval_s: float
    max_delay_s: float = float("inf")
    first_change: float | None = None  # the first change of the burst not yet handled
    last_change: float | None = None  # newest change not yet handled
    writing: bool = False  # a watched file is being written: not converged, nothing due yet
    last_reload: float | None = None  # when the previous reload was issued
    forced: bool = False  # a forced reload is asked for
    asked: bool = False  # a cycle is asked for, to go the way of a change
    retry_at: float | None = None  # when to try again to converge

    def changed(self, now: float) -> None:
        if self.first_change is None:
            self.first_change = now
        self.last_change = now

    def answered_again(self, now: float) -> bool:
        """The master CLI answers after failing: a retry waiting out its backoff is due now (True)."""
        if self.retry_at is None or self.retry_at <= now:
            return False
        self.retry_at = now
        return True

    @property
    def pending(self) -> bool:
        return self.forced or self.asked or self.writing or self.last_change is not None or self.retry_at is not None

    def _cause_and_time(self) -> tuple[Cause, float] | None:
        if self.forced:
            return "forced", float("-inf")
        if self.asked:
            return "asked", float("-inf")
        if self.last_change is not None:
            # A retry never reads a file that is still being written: the change's debounce wins.
            first = self.last_change if self.first_change is None else self.first_change
            return "change", min(self.last_change + self.debounce_s, first + self.max_delay_s)
        if self.retry_at is not None:
            return "retry", self.retry_at
        return None

    def due_at(self) -> float | None:
        due = self._cause_and_time()
        return None if due is None else max(due[1], self.earliest_reload())

    def earliest_reload(self) -> float:
        return float("-inf") if self.last_reload is None else self.last_reload + self.min_interval_s

    def take(self, now: float) -> Cause | None:
        """What is due at `now` (and everything pending consumed), or None."""
        due = self._cause_and_time()
        if due is None or now < max(due[1], self.earliest_reload()):
            return None
        self.clear()
        return due[0]

    def clear(self) -> None:
        self.writing = self.forced = self.asked = False
        self.first_change = self.last_change = self.retry_at = None


RETRY_FIRST_S = 0.5


def retry_delay(attempts: int, max_s: float) -> float:
    """0.5 s before the first retry, then twice as long each time, up to `max_s`."""
    return min(max_s, RETRY_FIRST_S * 2 ** min(attempts, 32))


@dataclass
class TransientHold:
    """A render that looks transient (runtime/plan.py) waits up to `hold_s` from the first of a row
    for the next one, which usually undoes it."""

    hold_s: float
    since: float | None = None  # when the first of the transient renders in a row came

    def check(self, running: Config | None, new: Config, now: float) -> tuple[float, str | None]:
        """(how long `new` should still wait over `running`, why); 0: go on with it."""
        why = None if running is None or self.hold_s <= 0 else transient_render(running, new)
        if why is None:
            self.since = None
            return 0.0, None
        if self.since is None:
            self.since = now
        left = max(self.since + self.hold_s - now, 0.0)
        if left == 0:
            self.since = None  # it goes on now: a later transient render is held anew
        return left, why


Action = Literal["skip", "runtime", "reload"]

# What a worker runs, or should: (effective sha256, watched files' digest; None when unknown).
Runs = tuple[str, str | None]


def decide_change(current: Runs | None, goal: Runs, *, force: bool, runtime_apply: bool) -> Action:
    """runtime when only the config changed (the watched files are as loaded) and a runtime apply is plugged in."""
    if current == goal and not force:
        return "skip"
    if runtime_apply and current is not None and not force and current[1] == goal[1]:
        return "runtime"
    return "reload"


Verdict = Literal["ok", "failed", "pending", "unknown"]


def confirm_reload(before: ProcList, after: ProcList) -> Verdict:
    """Did the reload take? ok: a current worker not there before; failed: HAProxy counted a failure."""
    if after.master is None:
        return "pending"
    known = {p.pid for p in (*before.workers, *before.old_workers)}
    current = after.current_worker
    if current is not None and current.pid not in known:
        return "ok"
    if after.master_failed > before.master_failed:
        return "failed"
    if before.master is not None and after.master.reloads > before.master.reloads and after.master_failed > 0:
        return "failed"
    return "pending"


# leave: the schedule stays as it is; stop: no attempt until the config changes or a reload is
# asked for; backoff: the next attempt after retry_delay (above).
Retry = Literal["leave", "stop", "backoff"]


def runs_goal(goal: Runs | None, current: Runs | None) -> bool:
    return goal is not None and goal == current


@dataclass(frozen=True)
class Attempt:
    record: ReloadRecord
    refused: bool = False


@dataclass(frozen=True)
class Facts:
    """What the judgement goes by, gathered when an attempt ends and between them."""

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
    """Converged, or why not, whether that passes, and when to retry. A config invalid or refused is
    not retried by itself (while HAProxy tries one, 2.6 pauses the serving worker's listeners)."""
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
