"""The push rounds' bookkeeping (steering/rounds.py) with a scripted master CLI: backoff after
a failed push, a drifted map pushed again, a cut-off read-back given UNREAD_LIMIT tries.
What HAProxy does with the lines is the end-to-end suite's (test_displaced_*_e2e.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rigs.wholes import inject_guard
from supervisor.haproxy.api import CLIError
from supervisor.haproxy.config import Config
from supervisor.settings import HAProxySettings, Settings
from supervisor.state import State
from supervisor.steering.dead import Sections, live_view
from supervisor.steering.live import LiveRead, LiveStates
from supervisor.steering.plan import Planner
from supervisor.steering.rounds import PushRounds, WorkerRecord
from supervisor.steering.workers import next_poll_in

PID = 999_999_999  # no such process: the old worker's record has no start time
RUNS = "defaults\n  mode http\nbackend b\n  server s1 10.0.0.1:80\n  server s2 10.0.0.2:80\n"
LATEST = "defaults\n  mode http\nbackend b\n  server s2 10.0.0.2:80\n"


class ScriptedCLI:
    """Answers map changes cleanly (one empty line per command), `show map` with `shown`,
    and raises `failing` while it is set; counts the lines it was sent."""

    def __init__(self) -> None:
        self.failing: CLIError | None = None
        self.shown = "\n"
        self.lines: list[str] = []

    async def execute(self, line: str, timeout: float | None = None) -> str:
        if self.failing is not None:
            raise self.failing
        self.lines.append(line)
        if " show map " in line:
            return self.shown
        return "\n" * (line.count(";") + 1)

    async def on(self, pid: int, command: str, timeout: float | None = None) -> str:
        return await self.execute(f"@!{pid} {command}", timeout)


def steered_worker(state: State) -> WorkerRecord:
    """An old worker whose map is known empty and whose plan steers it off b/s1."""
    sections = Sections()
    runs, latest = (sections.digest(inject_guard(Config.parse(t), "/run/hs/steer.map", "/run/hs/t.map"))
                    for t in (RUNS, LATEST))
    steering = Planner("fail-fast").plan(latest, live_view(latest, LiveStates(), ()), {PID: (runs, frozenset())})[PID]
    assert steering.steered == ["b/s1"]
    worker = WorkerRecord(PID, 1, held={}, pending=set())
    worker.want(steering)
    state.publish_old_workers({PID: 1}, {PID: None})
    return worker


def shown_map(worker: WorkerRecord) -> str:
    assert worker.wanted is not None
    return "".join(f"0x1 {key} {value}\n" for key, value in worker.wanted.entries().items()) + "\n"


async def test_a_failed_push_backs_off_then_is_retried_and_clears_the_failure():
    state, cli = State(), ScriptedCLI()
    rounds = PushRounds(Settings(), state, cli)  # type: ignore[arg-type]
    worker = steered_worker(state)
    cli.failing = CLIError("connection reset")
    await rounds.push_all([worker])
    assert (worker.failures, state.push_failures, state.old_workers[PID].push.state) == (1, 1, "failed")
    assert worker.held is None and worker.retry_at > time.monotonic()

    cli.failing = None
    await rounds.push_all([worker])  # backing off: nothing sent
    assert cli.lines == [] and state.old_workers[PID].push.state == "failed"

    await asyncio.sleep(max(0.0, worker.retry_at - time.monotonic()) + 0.01)
    cli.shown = "\n"  # the map is unknown after a failure: read first, then pushed
    await rounds.push_all([worker])
    assert worker.failures == 0 and state.old_workers[PID].push.state == "ok"
    assert state.old_workers[PID].steered == ["b/s1"]
    assert rounds.last_push["workers"] == 1 and rounds.last_push["changes"] > 0
    assert " show map " in cli.lines[0] and any(" add map " in line for line in cli.lines[1:])


async def test_a_map_read_back_that_differs_is_a_failure_and_wakes_a_round():
    state, cli, lock = State(), ScriptedCLI(), asyncio.Lock()
    rounds = PushRounds(Settings(), state, cli)  # type: ignore[arg-type]
    worker = steered_worker(state)
    await rounds.push_all([worker])
    assert worker.verify and state.old_workers[PID].push.state == "ok"

    cli.shown = shown_map(worker)  # as pushed
    assert await rounds.verify_some({PID: worker}, 0.25, lock) is False
    assert not worker.verify and worker.held is not None and state.push_failures == 0

    cli.shown = "\n"  # emptied behind our back (a reconcile is due at once)
    worker.verified_at -= rounds.RECONCILE_INTERVAL_S
    assert await rounds.verify_some({PID: worker}, 0.25, lock) is True
    assert worker.held is None and state.push_failures == 1
    record = state.old_workers[PID].push
    assert record.state == "failed" and record.error is not None and "map differs" in record.error


async def test_a_read_back_cut_off_counts_as_failed_only_after_unread_limit_tries():
    state, cli, lock = State(), ScriptedCLI(), asyncio.Lock()
    rounds = PushRounds(Settings(), state, cli)  # type: ignore[arg-type]
    worker = steered_worker(state)
    await rounds.push_all([worker])
    cli.shown = shown_map(worker)[:-1]  # no closing blank line: the master dropped the connection
    for _ in range(rounds.UNREAD_LIMIT - 1):
        assert await rounds.verify_some({PID: worker}, 0.25, lock) is False
        assert state.push_failures == 0 and state.old_workers[PID].push.state == "ok"
    await rounds.verify_some({PID: worker}, 0.25, lock)
    assert state.push_failures == 1 and worker.failures == 1
    assert state.old_workers[PID].push.state == "failed"


async def test_a_read_back_overlapping_a_push_proves_nothing():
    state, cli, lock = State(), ScriptedCLI(), asyncio.Lock()
    rounds = PushRounds(Settings(), state, cli)  # type: ignore[arg-type]
    worker = steered_worker(state)
    await rounds.push_all([worker])
    cli.shown = "\n"  # what a read that started before the push finished would see

    real = cli.execute

    async def push_meanwhile(line: str, timeout: float | None = None) -> str:
        answer = await real(line, timeout)
        worker.pushes += 2  # a push started and ended while the read was under way
        return answer

    cli.execute = push_meanwhile  # type: ignore[method-assign]
    assert await rounds.verify_some({PID: worker}, 0.25, lock) is False
    assert state.push_failures == 0 and worker.held is not None and worker.verify


async def test_a_round_steers_every_worker_before_it_tidies_any():
    """The phases after the routing ones go out only once every worker's routing lines were
    answered: on the master's few connections, one worker's tidy-up would delay another's
    steering."""

    def config(servers: list[str]) -> str:
        lines = "".join(f"  server {s} 10.0.0.{s[1:]}:80\n" for s in servers)
        return f"defaults\n  mode http\nbackend b\n  balance roundrobin\n{lines}"

    sections, planner = Sections(), Planner("fail-fast")
    runs, two_dead, one_dead = (
        sections.digest(inject_guard(Config.parse(config(servers)), "/run/hs/steer.map", "/run/hs/t.map"))
        for servers in (["s1", "s2", "s3", "s4"], ["s3", "s4"], ["s2", "s3", "s4"])
    )
    pids = (PID, PID + 1)
    plans = [
        planner.plan(latest, live_view(latest, LiveStates(), ()), {pid: (runs, frozenset()) for pid in pids})
        for latest in (two_dead, one_dead)
    ]

    class SlowerForOne(ScriptedCLI):
        async def execute(self, line: str, timeout: float | None = None) -> str:
            if line.startswith(f"@!{pids[1]} "):
                await asyncio.sleep(0.02)  # the second worker answers later than the first
            return await super().execute(line, timeout)

    state, cli = State(), SlowerForOne()
    state.publish_old_workers(dict.fromkeys(pids, 1), dict.fromkeys(pids))
    workers = []
    for pid in pids:
        worker = WorkerRecord(pid, 1, held=plans[0][pid].parts, pending=set())
        worker.want(plans[0][pid])
        worker.want(plans[1][pid])  # s2 is back: slots to drop once the count no longer promises them
        workers.append(worker)
    await PushRounds(Settings(), state, cli).push_all(workers)  # type: ignore[arg-type]
    stages = [("tidy" if " del map " in line else "routing", line.split()[0]) for line in cli.lines]
    assert {stage for stage, _ in stages} == {"routing", "tidy"}
    assert stages == sorted(stages, key=lambda s: s[0] == "tidy"), stages
    assert all(state.old_workers[pid].push.state == "ok" for pid in pids)


async def test_a_map_path_no_cli_line_can_carry_fails_the_push_and_nothing_is_sent():
    state, cli = State(), ScriptedCLI()
    settings = Settings(haproxy=HAProxySettings(runtime_dir=Path("/run/two words")))
    rounds = PushRounds(settings, state, cli)  # type: ignore[arg-type]
    worker = steered_worker(state)
    await rounds.push_all([worker])
    record = state.old_workers[PID].push
    assert record.state == "failed" and "invalid map path" in (record.error or "")
    assert cli.lines == [] and worker.failures == 1


async def test_reconciles_are_due_by_the_oldest_map_and_read_in_batches():
    state, cli, lock = State(), ScriptedCLI(), asyncio.Lock()
    rounds = PushRounds(Settings(), state, cli)  # type: ignore[arg-type]
    assert rounds.reconcile_due_at({}) is None  # nothing pushed: nothing to verify
    worker = steered_worker(state)
    await rounds.push_all([worker])
    cli.shown = shown_map(worker)
    await rounds.verify_some({PID: worker}, 0.25, lock)
    assert rounds.reconcile_due_at({PID: worker}) == worker.verified_at + rounds.RECONCILE_INTERVAL_S
    # A map whose turn is near is read with the one that is due: at 0.8 of the interval it is
    # read back, where a fresh one is not.
    lines = len(cli.lines)
    worker.verified_at -= 0.8 * rounds.RECONCILE_INTERVAL_S
    await rounds.verify_some({PID: worker}, 0.25, lock)
    assert len(cli.lines) > lines
    lines = len(cli.lines)
    await rounds.verify_some({PID: worker}, 0.25, lock)
    assert len(cli.lines) == lines


@pytest.mark.parametrize(
    ("due_in", "busy", "sleeps"),
    [
        ([], False, 0.25),  # nothing periodic known: a poll
        ([4.0, 1.5], False, 1.5),  # at rest: until the earliest look
        ([4.0, 1.5], True, 0.25),  # something under way: a poll
        ([0.1], False, 0.25),  # due sooner than a poll: a poll
        ([-3.0], False, 0.25),  # overdue: a poll
    ],
)
def test_the_poll_sleeps_until_the_earliest_look_at_rest(due_in, busy, sleeps):
    now = 100.0
    assert next_poll_in(now, 0.25, [now + d for d in due_in], busy) == sleeps


def test_workers_that_see_the_same_servers_down_hold_one_set():
    """Each read of `show servers state` makes its own keys: a fleet of old workers that all
    saw the same 10,000 servers DOWN would hold 10,000 keys each."""
    rounds = PushRounds(Settings(), State(), ScriptedCLI())
    down = {"b/s1": False, "b/s2": False}
    workers: dict[int, WorkerRecord] = {}
    rounds.track(workers, {1: 1}, 1, LiveRead(1, 0.0, LiveStates(alive_by_key=dict(down)), 0.0))
    rounds.track(workers, {1: 1, 2: 2}, 2, LiveRead(2, 1.0, LiveStates(alive_by_key=dict(down)), 0.0))
    assert workers[1].unusable == {"b/s1", "b/s2"} and workers[2].unusable is workers[1].unusable
    workers[3] = WorkerRecord(3, 3)
    rounds.own_views(workers, {3: LiveRead(3, 2.0, LiveStates(alive_by_key=dict(down)), 0.0)})
    assert workers[3].unusable is workers[1].unusable
    rounds.own_views(workers, {3: LiveRead(3, 3.0, LiveStates(alive_by_key={"b/s1": False}), 0.0)})
    assert workers[3].unusable == {"b/s1"} and workers[1].unusable == {"b/s1", "b/s2"}


class _CountedSet(frozenset):
    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedSet.compared += 1
        return frozenset.__eq__(self, other)

    __hash__ = frozenset.__hash__


def test_the_current_workers_read_is_shared_once_not_every_round():
    rounds = PushRounds(Settings(), State(), ScriptedCLI())
    workers = {1: WorkerRecord(1, 1, unusable=_CountedSet({"b/s1"}))}
    read = LiveRead(2, 0.0, LiveStates(alive_by_key={"b/s1": False}), 0.0)
    for _ in range(5):  # one read, five rounds
        rounds.track(workers, {1: 1, 2: 2}, 2, read)
    assert workers[2].unusable is workers[1].unusable
    assert _CountedSet.compared == 1
    rounds.track(workers, {1: 1, 2: 2}, 2, LiveRead(2, 1.0, LiveStates(alive_by_key={"b/s1": False}), 0.0))
    assert _CountedSet.compared == 2  # a new read is compared once
