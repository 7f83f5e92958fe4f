"""`RuntimeApplier`: what the reloader calls to apply a change without a reload, and to save the
server state before one. It owns the pending removals (docs/removals.md): in maint at the
placeholder they route nothing, and `del server` is retried in the background, without the master
lock. An old worker refuses every server command: there a removal ends once it holds no
connection to the server's address, or exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType

from ...master.processes import is_alive, socket_inodes
from ...master.sockdiag import TCP_ESTABLISHED, TCP_SYN_SENT, SockDiagError, tcp_sockets
from ...state import Generation, PendingRemoval
from ..answers import ServerState, is_servers_state, parse_servers_state
from ..api import CLIError, MasterCLI, on_process
from ..config import Config
from ..resolution import is_ip
from ..server_state import clear_server_state, save_server_state
from .apply import (
    PLACEHOLDER_ADDRESS,
    PLACEHOLDER_PORT,
    MembershipResult,
    apply_changes,
    apply_membership,
    deleted,
    send_commands,
)
from .plan import RuntimePlan, completed_plan, runtime_plan

log = logging.getLogger(__package__)

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
OLD_CHECK_S = 1.0  # how often an old worker's held connections to a removed server are counted


# What /status shows for a removal found after a restart, until HAProxy's first answer.
LEFT_BY_EARLIER_DAEMON = "left pending by an earlier daemon"


def _at_placeholder(state: ServerState) -> bool:
    """In maint at the placeholder: a removal whose `del server` was refused."""
    return state.in_maint and (state.address, state.port) == (PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT)


def left_pending(held: Iterable[ServerState], running: Config) -> list[str]:
    """Servers held at the placeholder that `running` lacks: removals an earlier daemon left."""
    wanted = running.server_map()
    return [s.key for s in held if s.key not in wanted and _at_placeholder(s)]


def retry_delay(tries: int) -> float:
    """The wait before the next `del server` of a removal refused `tries` times."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, tries - 1))


def why_ended(removal: PendingRemoval, current_pid: int | None, alive: bool, held: int | None) -> str | None:
    """Why `removal` ends now, or None: in an old worker once it exits or holds no connection to
    the address (`held`, None when uncounted); in the current worker only by `del server`."""
    if current_pid is None or removal.worker_pid == current_pid:
        return None
    if not alive:
        return f"worker {removal.worker_pid} exited"
    if removal.endpoint is None:
        return f"worker {removal.worker_pid} is no longer the current worker and its address is unknown"
    if held == 0:
        return f"old worker {removal.worker_pid} holds no connection to {removal.endpoint[0]}:{removal.endpoint[1]}"
    return None


def held_connections(pid: int, endpoint: tuple[str, int]) -> int | None:
    """Connections (connecting or established) `pid` holds to `endpoint`; None when unknown."""
    address, port = endpoint
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    address = socket.inet_ntop(family, socket.inet_pton(family, address))  # as the kernel spells it
    inodes = socket_inodes(pid)
    try:
        return sum(1 for s in tcp_sockets(family, (TCP_ESTABLISHED, TCP_SYN_SENT), (port,))
                   if s.dst == address and s.inode in inodes)
    except (SockDiagError, OSError) as exc:
        log.warning("cannot count worker %d's connections to %s:%d: %s", pid, address, port, exc)
        return None


Publish = Callable[[Mapping[str, PendingRemoval]], None]


class PendingRemovals:
    """Every worker's pending removals (`removals`; changes go to `publish`), retried by `run()`."""

    def __init__(
        self,
        cli: MasterCLI,
        remove_wait_s: float,
        current_pid: Callable[[], int | None] | None,
        publish: Publish | None,
    ) -> None:
        self.cli, self.remove_wait_s, self.current_pid = cli, remove_wait_s, current_pid
        self.prefix: dict[int, list[str]] = {}  # a worker's `experimental-mode on`, if it asked for it
        self._removals: dict[str, PendingRemoval] = {}
        self.removals: Mapping[str, PendingRemoval] = MappingProxyType(self._removals)
        self._publish = publish
        self._wake = asyncio.Event()

    def _changed(self) -> None:
        if self._publish is not None:
            self._publish(self._removals)

    def hold(
        self, worker_pid: int, answers: dict[str, str], prefix: Iterable[str] = (),
        endpoints: Mapping[str, tuple[str, int]] | None = None,
    ) -> None:
        """Hold the removals refused in `worker_pid` (key -> answer); `endpoints`: where they were."""
        now, wall = time.monotonic(), datetime.now(UTC)
        for key, answer in answers.items():
            self._removals[key] = PendingRemoval(
                key, int(worker_pid), wall, now, tries=1, last_answer=answer, next_try_monotonic=now + retry_delay(1),
                endpoint=(endpoints or {}).get(key),
            )
            log.info("worker %d: %s pending removal: %s; it is in maint at the placeholder and routes nothing, "
                     "`del server` is retried in the background", worker_pid, key, answer)
        if prefix:
            self.prefix[int(worker_pid)] = list(prefix)
        self._changed()
        self._wake.set()

    def holds(self, worker_pid: int, key: str) -> bool:
        removal = self.removals.get(key)
        return removal is not None and removal.worker_pid == worker_pid

    async def try_now(self, keys: Iterable[str]) -> list[str]:
        """One `del server` now for these pending removals; those still refused."""
        due = [self.removals[k] for k in keys if k in self.removals]
        await self._retry(due, time.monotonic())
        return [r.key for r in due if r.key in self.removals]

    async def run(self) -> None:
        """Retry what is due, sleeping in between; forever (a task of the daemon)."""
        while True:
            old = await self._end_replaced()
            if not self.removals:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.monotonic()
            current = [r for r in self.removals.values() if r.key not in old]
            due = [r for r in current if r.next_try_monotonic <= now]
            if due:
                await self._retry(due, now)
                continue
            self._wake.clear()
            wait = min([r.next_try_monotonic - now for r in current] + ([OLD_CHECK_S] if old else []))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()

    async def _end_replaced(self) -> set[str]:
        """End the old workers' removals that why_ended() says are over; the keys still pending there."""
        if self.current_pid is None:
            return set()
        current = self.current_pid()
        old: set[str] = set()
        ended = False
        for removal in [r for r in self._removals.values() if r.worker_pid != current]:
            alive = is_alive(removal.worker_pid)
            held = (await asyncio.to_thread(held_connections, removal.worker_pid, removal.endpoint)
                    if alive and removal.endpoint is not None and current is not None else None)
            why = why_ended(removal, current, alive, held)
            if why is None:
                old.add(removal.key)
                continue
            del self._removals[removal.key]
            ended = True
            log.info("%s pending removal ends: %s", removal.key, why)
        if ended:
            self._changed()
        return old

    async def _retry(self, due: list[PendingRemoval], now: float) -> None:
        by_worker: dict[int, list[PendingRemoval]] = {}
        for removal in due:
            by_worker.setdefault(removal.worker_pid, []).append(removal)
        for pid, removals in by_worker.items():
            shut = [r for r in removals if not r.sessions_shut_down and now - r.since_monotonic >= self.remove_wait_s]
            if shut:
                log.info("worker %d: sessions still on %d removed servers after %gs: shutting them down",
                         pid, len(shut), self.remove_wait_s)
                shutdown = [f"shutdown sessions server {r.key}" for r in shut]
                await send_commands(self.cli, pid, shutdown, self.prefix.get(pid, ()))
                for removal in shut:
                    if removal.key in self._removals:
                        self._removals[removal.key] = replace(self._removals[removal.key], sessions_shut_down=True)
            commands = [f"del server {r.key}" for r in removals]
            answers = await send_commands(self.cli, pid, commands, self.prefix.get(pid, ()))
            after = time.monotonic()
            for removal, command, answer in zip(removals, commands, answers, strict=True):
                if removal.key not in self._removals:
                    continue  # ended while the answer was on its way
                if deleted(command, answer, asked_before=True):
                    del self._removals[removal.key]
                    log.info("worker %d: %s deleted after %d tries, %.1fs after its removal", pid, removal.key,
                             removal.tries + 1, after - removal.since_monotonic)
                    continue
                held = self._removals[removal.key]
                self._removals[removal.key] = replace(
                    held, tries=held.tries + 1, last_answer=(answer or "no answer").strip(),
                    next_try_monotonic=after + retry_delay(held.tries + 1),
                )
            self._changed()


@dataclass(frozen=True)
class RuntimeOutcome:
    """`applied`: the whole change is live. `runs`: the model the worker now runs if the apply
    changed it, also when a reload must finish a change whose new servers are in service."""

    applied: bool
    runs: Config | None = None


class RuntimeApplier:
    """`runtime_apply(current, new_model) -> RuntimeOutcome` for the reloader. `forget`: servers
    whose sequence was refused, left out of the next state save: the reload starts them afresh."""

    def __init__(
        self,
        cli: MasterCLI,
        remove_wait_s: float = 10.0,
        *,
        background: bool = True,
        publish_removals: Publish | None = None,
        current_pid: Callable[[], int | None] | None = None,
    ) -> None:
        self.cli = cli
        self.remove_wait_s = remove_wait_s
        self.background = background
        self.forget: set[str] = set()
        # Workers this daemon has changed servers in: what they hold is what their model says.
        self._known_workers: set[int] = set()
        # Removals whose `del server` HAProxy still refuses; `run()` retries them.
        self.pending = PendingRemovals(cli, remove_wait_s, current_pid, publish_removals)

    async def resume_pending(self, current: Generation | None) -> list[str]:
        """After adopting a master: hold the removals an earlier daemon left pending; their keys."""
        if current is None or current.worker_pid is None:
            return []
        pid = current.worker_pid
        held = await self._servers_state(pid, "show servers state")
        if isinstance(held, str):
            log.warning("worker %d: %s, for pending removals", pid, held)
            return []
        keys = left_pending(held, current.model)
        if keys:
            self.pending.hold(pid, dict.fromkeys(keys, LEFT_BY_EARLIER_DAEMON))
        return keys

    async def __call__(self, current: Generation, new: Config) -> RuntimeOutcome:
        # `new` is an effective config, like the generation's model: they compare line for line.
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
        result = await apply_changes(self.cli, current.worker_pid, changes)
        self.forget.difference_update(change.key for change in result.applied)
        self.forget.update(refused.change.key for refused in result.refused)
        log.info(
            "runtime apply to worker %d: %d servers changed, %d refused, %d not sent, %d commands on %d lines",
            current.worker_pid, len(result.applied), len(result.refused), len(result.skipped),
            result.commands_sent, result.lines_sent,
        )
        return RuntimeOutcome(True, new) if result.ok else RuntimeOutcome(False)

    async def _apply_membership(self, current: Generation, plan: RuntimePlan, new: Config) -> RuntimeOutcome:
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
            # A daemon killed mid-change left part of it in a worker this one has not changed: complete it.
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
        # With the new servers in service the worker runs the new model: its steering goes by it once old.
        return RuntimeOutcome(False, new if result.made else None)

    async def _membership(self, pid: int, plan: RuntimePlan, new: Config) -> MembershipResult:
        return await apply_membership(
            self.cli, pid, plan, new, remove_wait_s=self.remove_wait_s, background=self.background
        )

    async def _completed(self, pid: int, plan: RuntimePlan, new: Config) -> RuntimePlan | str:
        held: list[ServerState] = []
        for backend in sorted(plan.backends):
            servers = await self._servers_state(pid, f"show servers state {backend}")
            if isinstance(servers, str):
                return servers
            held += servers
        # An add held at the placeholder is an earlier daemon's pending removal: delete it, add it afresh.
        adding = {a.key for a in plan.adds}
        stale = [s for s in held if s.key in adding and _at_placeholder(s)]
        if stale:
            commands = [f"del server {s.key}" for s in stale]
            answers = await send_commands(self.cli, pid, commands)
            gone = {s.key for s, c, a in zip(stale, commands, answers, strict=True) if deleted(c, a, asked_before=True)}
            log.info("worker %d: %d of %d servers left at the placeholder by an earlier removal deleted before "
                     "they are added again", pid, len(gone), len(stale))
            held = [s for s in held if s.key not in gone]
        return completed_plan(plan, held, new)

    async def _servers_state(self, pid: int, command: str) -> list[ServerState] | str:
        """Worker `pid`'s servers by `command` (`show servers state [<backend>]`), or why none."""
        try:
            answer = await self.cli.execute(on_process(pid, command))
        except CLIError as exc:
            return f"cannot read its servers: {exc}"
        if not is_servers_state(answer):
            return f"`{command}` answered: {answer.strip()[:200] or 'nothing'}"
        return parse_servers_state(answer)

    async def save_server_state(self, current: Generation, new_model: Config, path: Path) -> bool:
        """Before a reload to `new_model`: save the current worker's state, less `forget`."""
        if current.worker_pid is None:
            clear_server_state(path)
            return False
        saved = await save_server_state(
            self.cli, current.worker_pid, path, running=current.model, new=new_model, forget=self.forget
        )
        if saved:
            self.forget.clear()
        return saved
