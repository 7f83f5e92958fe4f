"""Did a reload take? Decided from `show proc`: while the reload waits, or later, by housekeeping,
for a reload HAProxy did not confirm within reload.timeout_s."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from ..effective import Effective
from ..haproxy.api import CLIError, ProcList
from ..haproxy.config import Config
from ..master.readiness import bind_ports, worker_ready
from ..state import ReloadRecord
from .base import Unconfirmed
from .convergence import Convergence

log = logging.getLogger(__package__)

CONFIRM_POLL_S = 0.05


Verdict = Literal["ok", "failed", "pending", "unknown"]


def confirm_reload(before: ProcList, after: ProcList) -> Verdict:
    """Did the reload take? Decided from two `show proc` answers.

    ok: a current worker that was not there before. failed: the master's `[failed: N]`
    grew, or the master reloaded (its counter moved) with failures and no new worker.
    HAProxy resets `failed` to 0 on a successful load, so "unchanged" is not required.
    """
    if after.master is None:
        return "pending"
    known = {p.pid for p in (*before.workers, *before.old_workers)}
    current = after.current_worker
    if current is not None and current.pid not in known:
        return "ok"
    if after.master_failed > before.master_failed:
        return "failed"
    if (
        before.master is not None
        and after.master.reloads > before.master.reloads
        and after.master_failed > 0
    ):
        return "failed"
    return "pending"


class Confirmation(Convergence):
    async def _show_proc_until(self, deadline: float) -> ProcList:
        """`show proc`, given up at `deadline`: a stopped master accepts a connection and never answers."""
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                return await self.cli.show_proc()
        except TimeoutError:
            raise CLIError("show proc: no answer within reload.timeout_s") from None

    async def _confirm(
        self, before: ProcList, deadline: float, ports: set[int]
    ) -> tuple[Verdict, ProcList | None, str | None]:
        after: ProcList | None = None
        while True:
            if not self.master.alive:
                return "failed", after, "haproxy master exited during the reload"
            try:
                after = await self._show_proc_until(deadline)
                verdict = confirm_reload(before, after)
                worker = after.current_worker
                if verdict == "ok" and worker is not None and not await worker_ready(self.cli, worker.pid, ports):
                    verdict = "pending"  # 3.1+ lists the new worker before it has loaded and bound
            except CLIError:
                self.cli_failed()
                verdict = "pending"
            if verdict == "ok":
                return "ok", after, None
            if verdict == "failed":
                assert after is not None
                self._refused = True
                return "failed", after, (
                    f"HAProxy could not load the new config (show proc: failed={after.master_failed}); "
                    "its reason is in HAProxy's own log lines on the daemon's stderr"
                )
            if time.monotonic() > deadline:
                return "unknown", after, (
                    f"no new worker in `show proc` within reload.timeout_s={self.settings.reload.timeout_s:g}s"
                )
            await asyncio.sleep(CONFIRM_POLL_S)

    def _reload_unknown(
        self, before: ProcList, effective: Effective, inputs: str, error: str, started: float, model: Config
    ) -> ReloadRecord:
        self._unconfirmed = Unconfirmed(before, effective, inputs, time.monotonic(), bind_ports(model))
        record = self._record("unknown", started, error)
        log.warning(
            "reload unknown duration_ms=%d: %s; HAProxy may still be loading it: %s keeps the new config "
            "and `show proc` settles it",
            record.duration_ms, error, self.settings.haproxy.effective_config,
        )
        return record

    async def _settle(self, procs: ProcList) -> bool:
        """Decide an unconfirmed reload from a later `show proc` (with master.lock held). True
        while HAProxy is still loading it: a new worker is listed but not ready yet (3.1+ lists
        it before it has loaded its config), so nothing else may be sent meanwhile."""
        pending = self._unconfirmed
        if pending is None:
            return False
        verdict = confirm_reload(pending.before, procs)
        worker = procs.current_worker
        if verdict == "ok" and worker is not None and not await worker_ready(self.cli, worker.pid, pending.ports):
            return True
        if verdict == "pending":
            return False
        self._unconfirmed = None
        waited = time.monotonic() - pending.sent
        if verdict == "ok":
            generation = self._loaded_by(pending.effective, pending.inputs, procs)
            log.info("reload settled ok generation=%d worker=%s: confirmed %.1fs after it was sent",
                     generation.number, generation.worker_pid, waited)
            await self._call_hook("after_reload", True)
        else:
            error = f"HAProxy could not load the new config (show proc: failed={procs.master_failed})"
            log.error("reload settled failed: %s", error)
            self._restore_loaded()
            self._refused = True
            self._assess(self._record("failed", pending.sent, error))
        return False
