"""The incident, end to end with real HAProxy: a node is drained while old workers keep
receiving requests on the connections they hold (staged by rigs/incident.py, which
bench/drain.py runs too): requests keep arriving on the old workers' kept-alive connections
for all three apps.

With the supervisor's displaced-worker component every one of them is answered at once by a
live server. The control (guard off) shows what it prevents: requests through the old
worker wait out the connect timeouts on the vanished servers and fail.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from rigs.harness import KeepAliveClient
from rigs.incident import APPS, Shape, daemon_supervised, staged_drain
from rigs.supervised import Supervised, supervised
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings

pytestmark = pytest.mark.haproxy

SHAPE = Shape(connect_timeout_s=0.5, retries=2)
CONNECT_TIMEOUT_S = SHAPE.connect_timeout_s


@dataclass
class Answer:
    generation: int
    app: str
    status: int
    body: str
    seconds: float


@dataclass
class Outcome:
    answers: list[Answer]
    fresh: list[Answer]  # requests on new connections, served by the new worker
    old_pids: list[int]
    sup: Supervised


async def _send(generation: int, app: str, client: KeepAliveClient, rounds: int) -> list[Answer]:
    answers = []
    for _ in range(rounds):
        if client.closing:  # the old worker said `connection: close` on its last answer
            break
        status, body, seconds = await client.get(f"/{app}", timeout=10)
        answers.append(Answer(generation, app, status, body, seconds))
        if status == 0:  # HAProxy closed the connection after a failed request
            break
    return answers


async def drain_under_old_workers(
    rundir: Path, guard: bool, generations: int, check, clients_per_app: int = 3, rounds: int = 20,
    supervise=supervised,
) -> None:
    """Run the incident with `generations` old workers alive at once; hand the outcome to `check`."""
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir),
        old_workers=OldWorkerSettings(guard=guard, poll_interval_ms=100),
    )
    async with staged_drain(settings, supervise, generations, clients_per_app, SHAPE) as drain:
        sup = drain.sup
        if guard:
            await sup.wait_steered(drain.old_pids)
        jobs = [
            _send(generation, app, client, rounds)
            for (generation, app), clients in drain.held.items()
            for client in clients
        ]
        answers = [a for batch in await asyncio.gather(*jobs) for a in batch]
        fresh_client = await KeepAliveClient(drain.front).connect()
        fresh = []
        for app in APPS:
            status, body, seconds = await fresh_client.get(f"/{app}")
            fresh.append(Answer(0, app, status, body, seconds))
        await fresh_client.close()
        await sup.refresh_state()
        check(Outcome(answers, fresh, drain.old_pids, sup))


def _check_protected(outcome: Outcome) -> None:
    answers = outcome.answers
    # Every app of every old generation was exercised on its old worker.
    seen = {(a.generation, a.app) for a in answers}
    assert seen == {(g, app) for g in range(1, len(outcome.old_pids) + 1) for app in APPS}, seen
    failed = [a for a in answers if a.status != 200]
    assert not failed, failed
    slow = [a for a in answers if a.seconds >= CONNECT_TIMEOUT_S / 2]
    assert not slow, f"requests waited on a dead server: {slow}"
    for a in answers:
        if a.app in ("echo", "highscale"):
            assert a.body == "fallback", a  # no primary left: the backup
        else:
            assert a.body in ("wide_r2", "wide_r3"), a  # spread over the live primaries
    # The guard picks a random slot per request and `wide` has 3 slots for 2 live servers, so
    # one of them gets 2 in 3 requests: enough requests make seeing both a certainty in
    # practice ((2/3)^20 < 5e-4), and too few would make this check flaky.
    wide = [a.body for a in answers if a.app == "wide"]
    assert len(wide) >= 20, len(wide)
    assert set(wide) == {"wide_r2", "wide_r3"}
    # What the supervisor shows about it.
    state = outcome.sup.state
    drained = {"echo/echo_r1", "highscale/highscale_r1", "highscale/highscale_r2", "wide/wide_r1"}
    assert drained <= state.dead_servers
    for pid in outcome.old_pids:
        worker = state.old_workers[pid]
        assert worker.push.state == "ok" and worker.push.error is None
        assert drained <= set(worker.steered), worker.steered
        assert worker.started_at is not None
    assert state.push_failures == 0
    assert state.push_duration.count >= 1
    # New connections go to the new worker and its moved replicas.
    assert [(a.app, a.status) for a in outcome.fresh] == [(app, 200) for app in APPS]
    assert outcome.fresh[0].body == "echo_r2"
    assert outcome.fresh[1].body in ("highscale_r3", "highscale_r4")


def _check_unprotected(outcome: Outcome) -> None:
    answers = outcome.answers
    # echo and highscale have no live primary; the old workers still count theirs as UP, so
    # requests wait out the connect timeouts (and retries) on the vanished node, then fail.
    for app in ("echo", "highscale"):
        mine = [a for a in answers if a.app == app]
        assert mine and all(a.status != 200 and a.seconds >= CONNECT_TIMEOUT_S for a in mine), mine
    assert not any(a.body == "fallback" for a in answers)
    state = outcome.sup.state
    for pid in outcome.old_pids:
        assert state.old_workers[pid].steered == []


async def test_incident_old_worker_is_steered_off_the_drained_node(rundir):
    await drain_under_old_workers(rundir, guard=True, generations=1, check=_check_protected)


async def test_incident_control_without_guard_requests_hang_on_the_drained_node(rundir):
    await drain_under_old_workers(rundir, guard=False, generations=1, check=_check_unprotected, rounds=1)


async def test_incident_with_five_generations_of_old_workers(rundir):
    await drain_under_old_workers(rundir, guard=True, generations=5, check=_check_protected, clients_per_app=2)


async def test_incident_through_the_daemon(rundir):
    """The same incident with `haproxy-supervisor run` doing everything: watching the rendered
    config, reloading, steering; the checks read its /status and /metrics."""
    await drain_under_old_workers(
        rundir, guard=True, generations=2, check=_check_protected, supervise=daemon_supervised
    )


async def test_incident_control_through_the_daemon_without_guard(rundir):
    await drain_under_old_workers(
        rundir, guard=False, generations=1, check=_check_unprotected, rounds=1, supervise=daemon_supervised
    )
