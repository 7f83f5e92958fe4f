"""Pending removals: servers the rendered config no longer has that the current worker still
holds, because HAProxy refuses `del server` while connections are attached to one.

Such a server is in maint at the placeholder address before it gets here: it routes nothing,
so the change is live and the node runs what the rendered config says. What is left is
bookkeeping, done in the background without the master lock: `del server` again after
RETRY_FIRST_S, the wait doubling up to RETRY_MAX_S, `shutdown sessions server` once the
server has waited `remove_wait_s`, for as long as that worker is the current one. After a
reload the new worker never had the server, and an old one refuses every server command: the
removal stays pending in the old worker for as long as it holds connections to the server's
address (counted through sock_diag every OLD_CHECK_S), and ends when it holds none or exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from types import MappingProxyType

from ...master.processes import is_alive, socket_inodes
from ...master.sockdiag import TCP_ESTABLISHED, TCP_SYN_SENT, SockDiagError, tcp_sockets
from ...state import PendingRemoval
from ..answers import ServerState
from ..api import DEFAULT_LINE_LIMIT, MasterCLI, on_process
from ..config import Config
from .add_remove import PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT
from .apply import deleted, send_line, send_step

log = logging.getLogger(__package__)

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
OLD_CHECK_S = 1.0  # how often an old worker's held connections to a removed server are counted


# What /status shows for a removal found after a restart, until HAProxy's first answer.
LEFT_BY_EARLIER_DAEMON = "left pending by an earlier daemon"


def left_pending(held: Iterable[ServerState], running: Config) -> list[str]:
    """Servers the worker holds (`show servers state`) that `running` (its generation's config)
    does not have, in maint at the placeholder: removals a daemon before this one left
    pending. A server out of the config elsewhere, or not in maint, is no removal of this
    daemon's making: it is left to the next change (plan.py: completed_plan)."""
    wanted = running.server_map()
    return [s.key for s in held if s.key not in wanted and s.in_maint
            and (s.address, s.port) == (PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT)]


def retry_delay(tries: int) -> float:
    """The wait before the next `del server` of a removal refused `tries` times."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, tries - 1))


def why_ended(removal: PendingRemoval, current_pid: int | None, alive: bool, held: int | None) -> str | None:
    """Why `removal` ends now, or None while it stays pending. In the current worker it ends
    by its `del server` alone. In an old one (after a reload) it ends when that worker exits,
    or holds no connection to the server's address any more (`held`, None when uncounted)."""
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
    """How many connections process `pid` holds to `endpoint` (connecting or established, by
    sock_diag); None when the kernel cannot be asked."""
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
    """The pending removals, the current worker's and old workers' (`removals`, a read-only view; each change is
    handed to `publish`, for /status and /metrics) and the task that retries them (`run()`)."""

    def __init__(
        self,
        cli: MasterCLI,
        remove_wait_s: float,
        current_pid: Callable[[], int | None] | None = None,
        line_limit: int = DEFAULT_LINE_LIMIT,
        publish: Publish | None = None,
    ) -> None:
        self.cli, self.remove_wait_s = cli, remove_wait_s
        self.current_pid, self.line_limit = current_pid, line_limit
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
        """Servers of `worker_pid` whose `del server` was refused (key -> its last answer), and
        where they were (key -> address, port) before they were moved to the placeholder."""
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
        """End the removals pending in old workers that why_ended() says are over; the keys of
        those still pending in old workers (no `del server` is sent to those)."""
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
                await self._send(pid, [f"shutdown sessions server {r.key}" for r in shut])
                for removal in shut:
                    if removal.key in self._removals:
                        self._removals[removal.key] = replace(self._removals[removal.key], sessions_shut_down=True)
            commands = [f"del server {r.key}" for r in removals]
            answers = await self._send(pid, commands)
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

    async def _send(self, pid: int, commands: list[str]) -> list[str | None]:
        prefix = self.prefix.get(pid)
        if not prefix:
            answers, _ = await send_step(self.cli, pid, commands, self.line_limit)
            return answers
        return [(await send_line(self.cli, ";".join([*prefix, on_process(pid, c)])))[-1] for c in commands]
