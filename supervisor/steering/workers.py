"""Keeps every old worker's steer map equal to its plan: each round lists the workers, plans and
pushes what differs. The current worker's map is empty except during a make-before-break."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from ..binary import chash_node_keys
from ..effective import Effective
from ..eventloop import give_back_free_heap, on_grid, wait_set
from ..haproxy.answers import ProcList, ServerKey
from ..haproxy.api import CLIError, MasterCLI
from ..haproxy.stderr import ServerEvent
from ..logs import RecurringCondition
from ..master.processes import WorkerExits, process_started_at
from ..settings import Settings
from ..state import Generation, State
from .dead import ConfigDigest, Digests, LiveView, live_view
from .handoff import HandOffs
from .live import LiveRead, LiveStates, live_read_interval, read_states, read_unusable, update_stats
from .plan import Planner, Steering, nothing_steered
from .rounds import Ahead, PushRounds, WorkerRecord

log = logging.getLogger("supervisor.steering")
R = TypeVar("R")


def worker_generations(procs: ProcList, generations: Mapping[int, Generation]) -> dict[int, int | None]:
    """Every worker PID of `show proc` -> the generation it runs, or None."""
    by_pid = {g.worker_pid: n for n, g in generations.items() if g.worker_pid is not None}
    return {p.pid: by_pid.get(p.pid) for p in (*procs.workers, *procs.old_workers)}


def next_poll_in(now: float, poll_s: float, due_at: list[float], busy: bool) -> float:
    """How long the poll loop sleeps: one poll while something is under way, else until the
    earliest periodic look is due. At rest nothing that finds nothing wakes it."""
    if busy or not due_at:
        return poll_s
    return max(poll_s, min(due_at) - now)


class _Interrupted(Exception):
    """A poll's read was called off for a reload."""


@dataclass(frozen=True)
class ReloadPlan:
    """One reload's steering round as a value, from prepare() to after_reload()."""

    next: ConfigDigest  # the config the reload sends
    leaving_pid: int | None  # the worker about to become old
    ahead: Mapping[int, Ahead] = field(default_factory=dict)  # the pushes to its plans, by PID
    effective: Effective | None = None  # the config the reload sends, for the hand-off


class OldWorkers:
    STATS_INTERVAL_S = 5.0  # old workers' connections and memory, for status: the page refreshes every 5 s
    # At rest (nothing woke the steering) `show proc` is asked this often: exits come through pidfds,
    # the daemon's own reloads wake the steering, so this finds only a reload made behind its back.
    LIST_INTERVAL_S = 10.0
    WARN_AFTER_S = 5.0  # CLI failures lasting longer than this are logged as warnings

    def __init__(self, settings: Settings, state: State, cli: MasterCLI) -> None:
        self.settings = settings
        self.state = state
        self.cli = cli
        self.poll_s = settings.old_workers.poll_interval_ms / 1000
        self.safety_net_s = settings.old_workers.state_read_interval_s
        self.rounds = PushRounds(settings, state, cli)
        self._workers: dict[int, WorkerRecord] = {}
        self._digests = Digests()
        self._planner = Planner(settings.old_workers.no_backup, chash_node_keys(settings.haproxy.binary))
        self._live: LiveRead | None = None
        self._live_stale = False  # HAProxy wrote that a server of the current worker changed
        self._view = LiveView()  # the last view: its `down` is carried over a new worker's first checks
        # The reload under way, from before_reload to after_reload: a poll's round in between
        # steers by it too, or it would undo the make-before-break.
        self._reloading: ReloadPlan | None = None
        self._dead_key: object = None  # what state.dead_servers was last made from
        self._reads: set[asyncio.Future[object]] = set()  # the poll's reads under way
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stats_at = 0.0
        self._listed_at = 0.0  # monotonic, the last round's `show proc`
        self._exits = WorkerExits(self._wake.set)
        self.handoffs = HandOffs(settings, state, cli) if settings.old_workers.hand_off else None

    async def run(self) -> None:
        failing_since: float | None = None
        # Polled every poll_interval_ms: a lasting failure (descriptors run out) is one line, not four a second.
        failing = RecurringCondition(log, logging.WARNING, "old workers: the master CLI keeps failing: %s")
        woken = True
        try:
            while True:
                try:
                    if woken or self._round_due():
                        await self.sync(fresh=self._live_due())
                    if await self._interruptible(self.rounds.verify_some(self._workers, self.poll_s, self._lock)):
                        self._wake.set()
                    unasked = [w.pid for w in self._workers.values() if w.unusable is None and not w.current]
                    views = await self._interruptible(read_unusable(self.cli, unasked))
                    if views:
                        self.state.publish_state_reads(len(views))
                        self.rounds.own_views(self._workers, views)
                        self._wake.set()
                        give_back_free_heap()  # each answer was the size of a whole config
                    if time.monotonic() >= self._stats_at:
                        self._stats_at = time.monotonic() + self.STATS_INTERVAL_S
                        await self._interruptible(update_stats(self.cli, self.state))
                    failing_since = None
                    failing.over("old workers: the master CLI answers again")
                except _Interrupted:
                    log.debug("old workers: poll interrupted by a reload")
                except CLIError as exc:
                    # The master socket resets connections while the master re-executes on a
                    # reload (seconds with a big config): only a lasting failure is worth a warning.
                    now = time.monotonic()
                    failing_since = failing_since or now
                    self._listed_at = 0.0  # list again at the next poll, not after LIST_INTERVAL_S
                    log.debug("old workers: %s", exc)
                    if now - failing_since > self.WARN_AFTER_S:
                        failing.happened(exc)
                except Exception:
                    log.exception("old workers: unexpected error")  # must not stop the protection of later reloads
                await wait_set(self._wake, on_grid(self._sleep_s()))
                woken = self._wake.is_set()
                self._wake.clear()
        finally:
            self._exits.close()

    async def prepare(self, effective: Effective) -> ReloadPlan:
        """The next config's plans and pushes, worked out while `haproxy -c` checks it; nothing is pushed."""
        async with self._lock:
            latest = await self._digests.of_effective(effective)
            current = self.state.current
            leaving = current.worker_pid if current is not None else None
            judged = self._judged(leaving)
            if judged:
                with contextlib.suppress(CLIError):
                    view = await self._live_view(latest, leaving, reuse=True)
                    plans = await self._plan(latest, view, judged)
                    ahead = await self.rounds.work_ahead(self._workers, plans)
                    return ReloadPlan(latest, leaving, ahead, effective=effective)
            return ReloadPlan(latest, leaving, effective=effective)

    async def before_reload(self, plan: ReloadPlan | None) -> ReloadPlan | None:
        """Make-before-break: steer the worker about to become old (and the old ones) away from
        the servers the next config drops. None (prepare failed): a round as at rest."""
        current = self.state.current
        if plan is not None:
            plan = self._reloading = replace(plan, leaving_pid=current.worker_pid if current is not None else None)
        for task in self._reads:  # the master relays one answer at a time: the pushes come first
            task.cancel()
        try:
            await self.sync()
        except CLIError as exc:
            log.warning("make-before-break steering failed: %s", exc)  # after_reload pushes again
        return plan

    async def after_reload(self, plan: ReloadPlan | None, ok: bool) -> bool:
        """After a confirmed reload, steer the new old worker at once; after a failed one, undo
        the make-before-break steering of the worker that stays current (`plan` None: a reload
        settled late). Whether the round went through."""
        self._reloading = None
        try:
            # The states read before the reload still hold: the new worker reports every server
            # UP until its checks have run, and the next poll reads it anyway.
            await self.sync(reuse=True)
        except CLIError as exc:
            log.warning("steering after %s reload failed: %s", "the" if ok else "a failed", exc)
            return False
        return True

    async def refresh(self) -> None:
        """Recompute and push now: a runtime apply changed the current config in place."""
        self._digests = Digests()
        await self.sync(fresh=True)

    def on_server_event(self, event: ServerEvent | None) -> None:
        """HAProxy wrote that a server changed state in worker `event.pid`: read its states again.
        None: lines may have been lost, so the current worker's states are read again, and the
        old workers' own views where `observe` can change them."""
        if event is None:
            changed = list(self._workers.values()) if self.settings.observe.enabled else []
        else:
            log.debug("server event: worker %d: %s %s", event.pid, event.key, event.change)
            changed = [w for w in [self._workers.get(event.pid)] if w is not None]
        for worker in changed:
            if not worker.current:
                self.rounds.server_changed(worker)
        if event is None or not changed or changed[0].current:
            self._live_stale = True  # the current worker, or a new one not listed yet
        self._wake.set()

    def wake(self) -> None:
        """Steer again now: the evidence changed (the stalled-connection detector's suspects)."""
        self._live_stale = True  # a suspect set `health down` shows in the current worker's states
        self._wake.set()

    def mark_dead(self, key: str) -> None:
        self.state.publish_operator_dead(ServerKey.parse(key), True)
        self._wake.set()

    def unmark_dead(self, key: str) -> None:
        self.state.publish_operator_dead(ServerKey.parse(key), False)
        self._wake.set()

    def has_server(self, key: str) -> bool:
        return self._digests.has_server(key, self.state.generations.values())

    async def sync(self, fresh: bool = False, reuse: bool = False) -> None:
        """One round: list the workers, plan, push what differs. `fresh`: read the current
        worker's server states first (outside the lock: a reload does not wait on it);
        `reuse`: go by the last read, whatever its age."""
        current = self.state.current
        if fresh and self._reloading is None and current is not None and current.worker_pid is not None:
            await self._interruptible(self._fetch_live(current.worker_pid))
        async with self._lock:
            procs = await self.cli.show_proc()
            if procs.master is None and not procs.workers:
                raise CLIError("show proc: no answer")  # the master dropped the connection mid-reload
            self._listed_at = time.monotonic()
            self._track(procs)
            await self._steer(procs, reuse)

    def _round_due(self) -> bool:
        """Whether a poll that nothing woke has a round to do: states to read, a push to retry,
        or the periodic listing (a worker started by someone else's reload)."""
        if self._live_due() or time.monotonic() - self._listed_at >= self.LIST_INTERVAL_S:
            return True
        return any(w.wanted is not None and not w.in_sync() for w in self._workers.values())

    def _judged(self, leaving: int | None) -> dict[int, tuple[ConfigDigest, frozenset[str]]]:
        """The old workers and the one about to become old: (digest, servers it skips) by PID."""
        return {
            w.pid: (self._digests.of(g), w.unusable or frozenset())
            for w in self._workers.values()
            if (not w.current or w.pid == leaving) and (g := self._generation_of(w)) is not None
        }

    def _generation_of(self, worker: WorkerRecord) -> Generation | None:
        return self.state.generations.get(worker.generation) if worker.generation is not None else None

    def _track(self, procs: ProcList) -> None:
        generations = worker_generations(procs, self.state.generations)
        current = procs.current_worker
        old = {p.pid: generations[p.pid] for p in procs.old_workers}
        self._exits.watch_only(old)
        targets = old if current is None else {**old, current.pid: generations[current.pid]}
        self.rounds.track(self._workers, targets, current.pid if current is not None else None, self._live)
        listed = self.state.old_workers
        self.state.publish_old_workers(old, {pid: process_started_at(pid) for pid in old if pid not in listed})

    async def _steer(self, procs: ProcList, reuse: bool) -> None:
        current = self.state.current
        reloading = self._reloading
        latest = reloading.next if reloading is not None else self._digests.of(current) if current is not None else None
        if latest is None:
            self.state.publish_dead_servers(())
            return
        leaving = reloading.leaving_pid if reloading is not None else None
        judged = self._judged(leaving)
        for worker in self._workers.values():
            generation = self._generation_of(worker)
            if generation is None:
                self.rounds.want(worker, None, "the config this worker runs is unknown: it cannot be steered")
            elif worker.pid not in judged:
                # Between reloads the current worker runs `latest`, digested already.
                digest = latest if reloading is None and generation is current else self._digests.of(generation)
                empty = nothing_steered(digest, latest, (latest.key, LiveView())) if digest.guarded else None
                self.rounds.want(worker, empty)
        plans: dict[int, Steering] = {}
        if judged:
            current_worker = procs.current_worker
            view = await self._live_view(latest, current_worker.pid if current_worker else None, reuse)
            plans = await self._plan(latest, view, judged)
            for pid, steering in plans.items():
                worker = self._workers[pid]
                if steering.digest.guarded:
                    self.rounds.want(worker, steering)
                else:
                    self.rounds.want(worker, None, "its config has no guard: it cannot be steered")
        await self.rounds.push_all(self._workers.values(), reloading.ahead if reloading is not None else None)
        if self.handoffs is not None:
            old = {w.pid: g for w in self._workers.values() if not w.current and (g := self._generation_of(w))}
            await self.handoffs.round(old, current, reloading.effective if reloading is not None else None)
        dead_key = tuple((s.basis, s.digest.key) for s in plans.values())
        if dead_key != self._dead_key:
            self._dead_key = dead_key
            self.state.publish_dead_servers(set().union(*(s.dead for s in plans.values())))
            self._planner.keep_only(self._digests.keep_only(self.state.generations.values(), latest))
        if self.settings.old_workers.shutdown_stuck_sessions:
            await self.rounds.sweep(self._workers.values())

    async def _plan(
        self, latest: ConfigDigest, view: LiveView, judged: dict[int, tuple[ConfigDigest, frozenset[str]]]
    ) -> dict[int, Steering]:
        """The planner's plans (a recent one for the same basis and worker content, such as the
        reload's prepare's, taken as it is), one worker at a time, the event loop let run after
        each plan worked out: a turn after a plan found would only delay the pushes."""
        plans: dict[int, Steering] = {}
        for pid, worker in judged.items():
            worked_out = self._planner.worked_out
            plans.update(self._planner.plan(latest, view, {pid: worker}))
            if self._planner.worked_out != worked_out:
                await asyncio.sleep(0)
        return plans

    async def _live_view(self, latest: ConfigDigest, current_pid: int | None, reuse: bool = False) -> LiveView:
        # Around a reload the last answer will do, whatever its age: the steering must not wait
        # on a 10,000-line answer, and a new worker reports every server UP until it checked them.
        stale = not reuse and self._reloading is None and self._live_due()
        if current_pid is not None and (self._live is None or stale):
            await self._fetch_live(current_pid)
        states = self._live.states if self._live is not None else LiveStates()
        view = live_view(latest, states, self.state.operator_dead, self._view.down, self.state.suspect_servers.values())
        # The same view, not an equal copy: every plan under it holds it as its basis.
        if view != self._view:
            self._view = view
        return self._view

    def _live_due(self) -> bool:
        return time.monotonic() >= self._live_due_at()

    def _live_due_at(self) -> float:
        current = self.state.current
        if self._live is None or current is None or self._live_stale or current.worker_pid != self._live.pid:
            return 0.0
        digest, live = self._digests.of(current), self._live
        interval = live_read_interval(
            live.cost_s, self.poll_s, self.safety_net_s, changes_alone=digest.changes_alone,
            heard=self.state.server_events and not digest.quiet, unchecked=bool(live.states.pending),
        )
        return live.at + interval

    def _sleep_s(self) -> float:
        busy = any(
            w.verify or (w.wanted is not None and not w.in_sync()) or (w.unusable is None and not w.current)
            for w in self._workers.values()
        )
        due = [self._listed_at + self.LIST_INTERVAL_S, self._stats_at, self._live_due_at()]
        reconcile = self.rounds.reconcile_due_at(self._workers)
        if reconcile is not None:
            due.append(reconcile)
        return next_poll_in(time.monotonic(), self.poll_s, due, busy)

    async def _fetch_live(self, pid: int) -> None:
        self._live_stale = False  # a line written while the read is under way calls for another
        self.state.publish_state_reads(1)
        self._live = await read_states(self.cli, pid, self._live.states if self._live is not None else None)

    async def _interruptible(self, read: Coroutine[object, object, R]) -> R:
        """Run a poll's read so that before_reload can call it off (raising _Interrupted); what a
        read learns is applied after it returns, so none is left half done."""
        task = asyncio.ensure_future(read)
        self._reads.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise _Interrupted from None
            raise
        finally:
            self._reads.discard(task)
