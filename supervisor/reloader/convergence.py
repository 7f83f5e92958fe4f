"""Does the node run the rendered config? When not, after a failed or unconfirmed attempt, when to
try again (with backoff), or why not to."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from ..state import ReloadRecord, utcnow
from .bookkeeping import Bookkeeping
from .problems import one_line
from .schedule import retry_delay

log = logging.getLogger(__package__)


def runs_goal(goal: tuple[str, str | None] | None, current: tuple[str, str | None] | None) -> bool:
    """Does the current worker run the goal? Both are (effective sha256, watched files' digest)."""
    return goal is not None and current is not None and goal == current


class Convergence(Bookkeeping):
    def _assess(self, record: ReloadRecord | None) -> None:
        """Compare what the current worker runs (from `show proc`) with the goal; when they differ
        after a failed or unconfirmed attempt, set the next attempt, with backoff."""
        convergence = self.state.convergence
        current = self.state.current
        runs = None if current is None else (current.effective_sha256, self._inputs.get(current.number))
        if (
            self.master.up
            and self.state.master_socket_ok
            and self._unconfirmed is None
            and not self.scheduler.pending
            and runs_goal(self._goal, runs)
        ):
            if not convergence.converged:
                # A write that changed nothing, or a reload that went through, says so itself.
                routine = convergence.attempts == 0 and convergence.reason == "a change is pending"
                log.log(logging.DEBUG if routine else logging.INFO,
                        "converged: worker %s runs the rendered config (sha256=%s) after %.1fs, %d retries",
                        current.worker_pid if current else None, self._goal[0][:12] if self._goal else None,
                        convergence.unconverged_s(utcnow()), convergence.attempts)
            convergence.reached()
            return
        if record is not None and record.result == "invalid":
            self.scheduler.retry(None)
            convergence.next_attempt_at = None
            convergence.missed(f"the rendered config is invalid: {one_line(record.error or '', 200)}", transient=False)
            return
        if not self.master.up:
            convergence.missed("the HAProxy master is not running", transient=True)
        elif not self.state.master_socket_ok:
            convergence.missed(f"{self.settings.haproxy.master_socket_path} is missing", transient=True)
        elif record is not None and record.result in ("failed", "unknown"):
            error = one_line(record.error or "", 200)
            why = f"HAProxy refused the new config: {error}" if self._refused else f"reload {record.result}: {error}"
            convergence.missed(why, transient=not self._refused)
        elif self._unconfirmed is not None:
            convergence.missed("HAProxy has not confirmed the last reload yet", transient=True)
        elif convergence.converged or record is not None:
            why = "the current worker does not run the rendered config"
            convergence.missed("a change is pending" if self.scheduler.pending else why, transient=True)
        if self._refused and record is not None and record.result == "failed":
            # Not retried by itself: HAProxy refused the config (a port in use), and while it tries
            # one (2.6: "Paused frontend") the serving worker's listeners accept nothing. The next
            # change, SIGHUP or POST /reload tries again.
            self.scheduler.retry(None)
            convergence.next_attempt_at = None
            log.warning("not converged: %s; not retried until the config changes or a reload is asked for",
                        convergence.reason)
            return
        if record is not None and record.result in ("failed", "unknown") and self.scheduler.retry_at is None:
            delay = retry_delay(convergence.attempts, self.settings.reload.retry_max_s)
            convergence.attempts += 1
            convergence.next_attempt_at = utcnow() + timedelta(seconds=delay)
            self.scheduler.retry(time.monotonic() + delay)
            self._wake.set()
            log.warning("not converged for %.1fs: %s; attempt %d in %.1fs",
                        convergence.unconverged_s(utcnow()), convergence.reason, convergence.attempts, delay)
