"""`RuntimeApplier`: what the reloader calls to apply a change without a reload, and to save
the current worker's server state before one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..answers import is_servers_state, parse_servers_state
from ..api import DEFAULT_LINE_LIMIT, CLIError, MasterCLI, on_process
from ..config import Config
from ..resolution import is_ip
from ..server_state import clear_server_state, save_server_state
from .add_remove import PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT, MembershipResult, apply_membership
from .apply import ApplyResult, apply_changes, deleted, send_step
from .pending import LEFT_BY_EARLIER_DAEMON, PendingRemovals, Publish, left_pending
from .plan import RuntimePlan, completed_plan, runtime_plan

log = logging.getLogger(__package__)


class _Generation(Protocol):
    @property
    def model(self) -> Config: ...

    @property
    def worker_pid(self) -> int | None: ...


class _Effective(Protocol):
    text: str


@dataclass(frozen=True)
class RuntimeOutcome:
    """What a runtime apply left the current worker running.

    `applied`: the whole change is live, no reload is needed. `runs`: the model the worker
    now runs when the apply changed it: the new one when applied, or, when a reload must
    finish the change, the new config's servers (removed ones left in maint) once the new
    servers are in service there; None when its servers are as they were.
    """

    applied: bool
    runs: Config | None = None


class RuntimeApplier:
    """`runtime_apply(current, new_model, effective) -> RuntimeOutcome` for the reloader.

    Applied: the change is live in the current worker and no reload is needed (the reloader
    then writes the effective config and records the generation the worker now runs).
    Not applied: a reload must do it; either the plan needs one, or a command was refused.
    Servers whose sequence was refused are remembered in `forget`, so that the next
    server-state save leaves them out and the reload starts them from the config rather
    than keeping them in the maint this module left them in.
    """

    def __init__(
        self,
        cli: MasterCLI,
        line_limit: int = DEFAULT_LINE_LIMIT,
        remove_wait_s: float = 10.0,
        *,
        background: bool = True,
        publish_removals: Publish | None = None,
        current_pid: Callable[[], int | None] | None = None,
    ) -> None:
        self.cli = cli
        self.line_limit = line_limit
        self.remove_wait_s = remove_wait_s
        self.background = background
        self.forget: set[str] = set()
        self.last_result: ApplyResult | None = None
        # Workers this daemon has changed servers in: what they hold is what their model says.
        self._known_workers: set[int] = set()
        # Removals whose `del server` HAProxy still refuses; `run()` retries them.
        self.pending = PendingRemovals(cli, remove_wait_s, current_pid, line_limit, publish_removals)

    async def run(self) -> None:
        """The background retries of pending removals (a task for as long as the daemon runs)."""
        await self.pending.run()

    async def resume_pending(self, current: _Generation | None) -> list[str]:
        """After adopting a master: the removals a daemon before this one left pending in the
        current worker (left_pending), held and retried like the applier's own; their keys."""
        if current is None or current.worker_pid is None:
            return []
        pid = current.worker_pid
        try:
            answer = await self.cli.on(pid, "show servers state")
        except CLIError as exc:
            log.warning("worker %d: cannot read its servers for pending removals: %s", pid, exc)
            return []
        if not is_servers_state(answer):
            log.warning("worker %d: `show servers state` answered: %s", pid, answer.strip()[:200] or "nothing")
            return []
        keys = left_pending(parse_servers_state(answer), current.model)
        if keys:
            self.pending.hold(pid, dict.fromkeys(keys, LEFT_BY_EARLIER_DAEMON))
        return keys

    async def __call__(
        self, current: _Generation, new_model: Config, effective: _Effective | None = None
    ) -> RuntimeOutcome:
        # Compare effective with effective: the generation's model is the effective config.
        new = effective.effective_model if effective is not None else new_model
        if current.worker_pid is None:
            return RuntimeOutcome(False)
        plan = runtime_plan(current.model, new)
        changes = plan.changes
        if changes is None:
            log.info("runtime apply not possible, reloading: %s", plan.why_reload)
            return RuntimeOutcome(False)
        if plan.membership_changes:
            return await self._apply_membership(current, plan, new)
        if not changes:
            return RuntimeOutcome(True, new)
        result = await apply_changes(self.cli, current.worker_pid, changes, line_limit=self.line_limit)
        self.last_result = result
        for change in result.applied:
            self.forget.discard(change.key)
        for refused in result.refused:
            self.forget.add(refused.change.key)
        log.info(
            "runtime apply to worker %d: %d servers changed, %d refused, %d not sent, %d commands on %d lines",
            current.worker_pid, len(result.applied), len(result.refused), len(result.skipped),
            result.commands_sent, result.lines_sent,
        )
        return RuntimeOutcome(True, new) if result.ok else RuntimeOutcome(False)

    async def _apply_membership(self, current: _Generation, plan: RuntimePlan, new: Config) -> RuntimeOutcome:
        assert current.worker_pid is not None
        pid = current.worker_pid
        back = [a.key for a in plan.adds if self.pending.holds(pid, a.key)]
        if back and (still := await self.pending.try_now(back)):
            # The worker holds a server of that name still; a reload starts from the config.
            log.info("runtime apply not possible, reloading: %s added back while its removal is pending: %s",
                     still[0], self.pending.removals[still[0]].last_answer)
            return RuntimeOutcome(False)
        result = await self._membership(pid, plan, new)
        if result.held_already and pid not in self._known_workers:
            # A worker this daemon has not changed yet holds part of this change: a daemon
            # before it was killed in the middle of it. Complete it by what the worker holds.
            completed = await self._completed(pid, plan, new)
            if isinstance(completed, str):
                log.info("worker %d holds part of this change, and %s", pid, completed)
            else:
                log.info("worker %d holds part of this change already (%d of %d added servers, %d of %d removed "
                         "servers gone, %d more to remove): completing it at runtime", pid, len(completed.present),
                         len(plan.adds), len(set(plan.removes) - set(completed.removes)), len(plan.removes),
                         len(set(completed.removes) - set(plan.removes)))
                first = result
                plan, result = completed, await self._membership(pid, completed, new)
                result.pending = {**first.pending, **result.pending}
        self._known_workers = {pid}
        if result.pending:
            servers = current.model.server_map()
            endpoints = {k: (servers[k].address, servers[k].port) for k in result.pending
                         if k in servers and servers[k].port is not None and is_ip(servers[k].address)}
            self.pending.hold(pid, result.pending, result.mode, endpoints)
        log.info(
            "runtime apply to worker %d: %d servers added, %d removed, %d pending removal, %d changed in place, "
            "%d commands",
            pid, len(result.added), len(result.removed), len(result.pending), len(plan.changes or ()),
            result.commands_sent,
        )
        if result.ok:
            return RuntimeOutcome(True, new)
        log.info("runtime apply not possible, reloading: %s", result.why)
        # Once the new servers are in service there, the worker runs the new config's servers
        # (and removed ones left in maint), which is what its steering must go by once old.
        return RuntimeOutcome(False, new if result.made else None)

    async def _membership(self, pid: int, plan: RuntimePlan, new: Config) -> MembershipResult:
        return await apply_membership(
            self.cli, pid, plan, new, remove_wait_s=self.remove_wait_s, line_limit=self.line_limit,
            background=self.background,
        )

    async def _completed(self, pid: int, plan: RuntimePlan, new: Config) -> RuntimePlan | str:
        held = []
        for backend in sorted(plan.backends):
            try:
                answer = await self.cli.execute(on_process(pid, f"show servers state {backend}"))
            except CLIError as exc:
                return f"cannot read its servers: {exc}"
            if not is_servers_state(answer):
                return f"`show servers state {backend}` answered: {answer.strip()[:200] or 'nothing'}"
            held += parse_servers_state(answer)
        # An add held in maint at the placeholder is a removal an earlier daemon left pending
        # (the name came back): delete it, and add it afresh.
        adding = {a.key for a in plan.adds}
        stale = [s for s in held if s.key in adding and s.in_maint
                 and (s.address, s.port) == (PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT)]
        if stale:
            commands = [f"del server {s.key}" for s in stale]
            answers, _ = await send_step(self.cli, pid, commands, self.line_limit)
            gone = {s.key for s, c, a in zip(stale, commands, answers, strict=True) if deleted(c, a, asked_before=True)}
            log.info("worker %d: %d of %d servers left at the placeholder by an earlier removal deleted before "
                     "they are added again", pid, len(gone), len(stale))
            held = [s for s in held if s.key not in gone]
        return completed_plan(plan, held, new)

    async def save_server_state(self, current: _Generation, new_model: Config, path: Path) -> bool:
        """Before a reload to `new_model`: save the current worker's state, minus what must not carry over."""
        if current.worker_pid is None:
            clear_server_state(path)
            return False
        saved = await save_server_state(
            self.cli, current.worker_pid, path, running=current.model, new=new_model, forget=self.forget
        )
        if saved:
            self.forget.clear()
        return saved
