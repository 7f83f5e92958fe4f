"""Did a reload take? Decided from `show proc` by a pure function, while the reload waits; and
`Confirmation`, which owns a reload HAProxy did not confirm within reload.timeout_s until a
later `show proc` settles it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..effective import Effective
from ..haproxy.answers import ProcList
from ..haproxy.api import CLIError, MasterCLI
from ..master import MasterProcess
from ..master.readiness import worker_ready

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


@dataclass(frozen=True)
class Unconfirmed:
    """A reload HAProxy did not confirm within reload.timeout_s: it may still take (a big
    config loads for a minute), so the new config stays on disk until `show proc` settles it."""

    before: ProcList
    effective: Effective
    inputs: str
    sent: float  # monotonic
    ports: set[int]  # the config's listening ports: a new worker is ready once it listens on them


@dataclass(frozen=True)
class Confirmed:
    """How a reload ended while it was waited for."""

    verdict: Verdict
    after: ProcList | None
    error: str | None = None
    refused: bool = False  # HAProxy could not load the config


@dataclass(frozen=True)
class Settled:
    """What a later `show proc` says of the unconfirmed reload. loading: a new worker is listed
    but not ready yet, so nothing else may be sent; pending: no verdict yet; ok and failed: the
    reload `of` is decided, and no longer held."""

    verdict: Literal["loading", "pending", "ok", "failed"]
    of: Unconfirmed | None = None


class Confirmation:
    """Confirms a reload from `show proc`, and holds one HAProxy has not confirmed (`unconfirmed`)."""

    def __init__(self, cli: MasterCLI, master: MasterProcess, timeout_s: float,
                 cli_failed: Callable[[], None]) -> None:
        self.cli = cli
        self.master = master
        self.timeout_s = timeout_s
        self.cli_failed = cli_failed
        self.unconfirmed: Unconfirmed | None = None

    async def show_proc_until(self, deadline: float) -> ProcList:
        """`show proc`, given up at `deadline`: a stopped master accepts a connection and never answers."""
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                return await self.cli.show_proc()
        except TimeoutError:
            raise CLIError("show proc: no answer within reload.timeout_s") from None

    async def confirm(self, before: ProcList, deadline: float, ports: set[int]) -> Confirmed:
        after: ProcList | None = None
        while True:
            if not self.master.alive:
                return Confirmed("failed", after, "haproxy master exited during the reload")
            try:
                after = await self.show_proc_until(deadline)
                verdict = confirm_reload(before, after)
                worker = after.current_worker
                if verdict == "ok" and worker is not None and not await worker_ready(self.cli, worker.pid, ports):
                    verdict = "pending"  # 3.1+ lists the new worker before it has loaded and bound
            except CLIError:
                self.cli_failed()
                verdict = "pending"
            if verdict == "ok":
                return Confirmed("ok", after)
            if verdict == "failed":
                assert after is not None
                return Confirmed("failed", after, (
                    f"HAProxy could not load the new config (show proc: failed={after.master_failed}); "
                    "its reason is in HAProxy's own log lines on the daemon's stderr"
                ), refused=True)
            if time.monotonic() > deadline:
                return Confirmed("unknown", after, (
                    f"no new worker in `show proc` within reload.timeout_s={self.timeout_s:g}s"
                ))
            await asyncio.sleep(CONFIRM_POLL_S)

    def hold(self, before: ProcList, effective: Effective, inputs: str, ports: set[int]) -> None:
        """The reload was not confirmed in time: held until `show proc` settles it."""
        self.unconfirmed = Unconfirmed(before, effective, inputs, time.monotonic(), ports)

    def take(self) -> Unconfirmed | None:
        """The unconfirmed reload, no longer held (a master restarted on its config)."""
        held, self.unconfirmed = self.unconfirmed, None
        return held

    async def settle(self, procs: ProcList) -> Settled | None:
        """Decide the unconfirmed reload from a later `show proc` (with master.lock held); None
        when there is none."""
        held = self.unconfirmed
        if held is None:
            return None
        verdict = confirm_reload(held.before, procs)
        worker = procs.current_worker
        if verdict == "ok" and worker is not None and not await worker_ready(self.cli, worker.pid, held.ports):
            return Settled("loading")
        if verdict == "pending":
            return Settled("pending")
        self.unconfirmed = None
        return Settled("ok" if verdict == "ok" else "failed", held)
