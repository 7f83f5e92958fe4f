"""The incident, end to end with real HAProxy: a node is drained while old workers keep
receiving requests on the connections they hold.

A Ray Serve-shaped config: app `echo` (1 replica) and `highscale` (2) live only on the node
that gets drained, `wide` has 1 of its 3 replicas there, and every backend has a `fallback`
backup. The replicas move, HAProxy reloads, the drained node vanishes (connects hang), and
requests keep arriving on the old workers' kept-alive connections for all three apps.

With the supervisor's displaced-worker component every one of them is answered at once by a
live server. The control (guard off) shows what it prevents: requests through the old
worker wait out the connect timeouts on the vanished servers and fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings
from tests.support.daemon import DaemonSupervised, daemons
from tests.support.harness import KeepAliveClient, VanishedNode, backends, free_port
from tests.support.supervised import Supervised, supervised

pytestmark = pytest.mark.haproxy

CONNECT_TIMEOUT_S = 0.5
APPS = ("echo", "highscale", "wide")
DRAINED = ("echo_r1", "highscale_r1", "highscale_r2", "wide_r1")  # all on the node being drained
SURVIVORS = ("wide_r2", "wide_r3", "fallback")
MOVED = ("echo_r2", "highscale_r3", "highscale_r4", "wide_r4")  # where the drained replicas went

HEAD = """\
global
    hard-stop-after 120s
    # Old workers keep their connections and keep taking requests on them.
    close-spread-time 120s

defaults
    mode http
    timeout connect {connect_ms}ms
    timeout client 30s
    timeout server 30s
    timeout http-keep-alive 30s
    option idle-close-on-response
    retries 2
    option redispatch
    balance leastconn

frontend http_frontend
    bind 127.0.0.1:{front}
    acl is_echo path_beg /echo
    acl is_highscale path_beg /highscale
    acl is_wide path_beg /wide
    use_backend echo if is_echo
    use_backend highscale if is_highscale
    use_backend wide if is_wide
"""


def rendered(front: int, ports: dict[str, int], servers: dict[str, list[str]]) -> str:
    """A rendered config with `servers[app]` as the app's primaries and `fallback` as backup."""
    text = HEAD.format(front=front, connect_ms=int(CONNECT_TIMEOUT_S * 1000))
    for app in APPS:
        text += f"\nbackend {app}\n"
        for name in servers[app]:
            process = name.split("@")[-1]
            text += f"    server {name.split('@')[0]} 127.0.0.1:{ports[process]} check inter 300ms\n"
        text += f"    server fallback 127.0.0.1:{ports['fallback']} check inter 300ms backup\n"
    return text


BEFORE = {"echo": ["echo_r1"], "highscale": ["highscale_r1", "highscale_r2"], "wide": ["wide_r1", "wide_r2", "wide_r3"]}
AFTER = {"echo": ["echo_r2"], "highscale": ["highscale_r3", "highscale_r4"], "wide": ["wide_r4", "wide_r2", "wide_r3"]}


def intermediate(k: int) -> dict[str, list[str]]:
    """Generation k before the drain: the same replicas, plus one more for `wide` (served by
    wide_r3's process), so every generation runs a config of its own."""
    servers = {app: list(names) for app, names in BEFORE.items()}
    servers["wide"] += [f"wide_extra{i}@wide_r3" for i in range(2, k + 1)]
    return servers


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


@contextlib.asynccontextmanager
async def the_daemon(settings: Settings, rendered_text: str) -> AsyncIterator[DaemonSupervised]:
    """`haproxy-supervisor run` as a subprocess, with the settings that matter here."""
    with daemons(settings.haproxy.runtime_dir) as make:
        daemon = make(rendered_text, {
            "old_workers": {"guard": settings.old_workers.guard, "poll_interval_ms": 100},
            "reload": {"runtime_apply": True},
        })
        daemon.start()
        await daemon.wait_generation(1)
        yield DaemonSupervised(daemon)


async def drain_under_old_workers(
    rundir: Path, guard: bool, generations: int, check, clients_per_app: int = 3, rounds: int = 20,
    supervise=supervised,
) -> None:
    """Run the incident with `generations` old workers alive at once; hand the outcome to `check`."""
    front = free_port()
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir),
        old_workers=OldWorkerSettings(guard=guard, poll_interval_ms=100),
    )
    with backends(*DRAINED, *SURVIVORS, *MOVED) as started:
        ports = {name: b.port for name, b in started.items()}
        held: dict[tuple[int, str], list[KeepAliveClient]] = {}
        keepers: list[KeepAliveClient] = []
        vanished: list[VanishedNode] = []
        async with supervise(settings, rendered(front, ports, intermediate(1))) as sup:
            try:
                old_pids = []
                for generation in range(1, generations + 1):
                    # Clients of this generation's worker, each with a first good answer.
                    for app in APPS:
                        held[generation, app] = [await KeepAliveClient(front).connect() for _ in range(clients_per_app)]
                        for client in held[generation, app]:
                            status, _, _ = await client.get(f"/{app}")
                            assert status == 200
                    # A request that fails on connect closes its connection: this idle one keeps
                    # the old worker alive until the end, whatever happens to the others.
                    keepers.append(await KeepAliveClient(front).connect())
                    old_pids.append(sup.current_pid)
                    if generation < generations:
                        await sup.reload(rendered(front, ports, intermediate(generation + 1)))
                # The replicas move: a new rendered config, and a reload.
                await sup.reload(rendered(front, ports, AFTER))
                assert sorted(sup.master.worker_pids()[1]) == sorted(old_pids)
                # The drained node vanishes.
                for name in DRAINED:
                    started[name].stop()
                    vanished.append(VanishedNode(ports[name]))
                assert all(node.connect_hangs() for node in vanished)
                if guard:
                    await sup.wait_steered(old_pids)
                jobs = [
                    _send(generation, app, client, rounds)
                    for (generation, app), clients in held.items()
                    for client in clients
                ]
                answers = [a for batch in await asyncio.gather(*jobs) for a in batch]
                fresh_client = await KeepAliveClient(front).connect()
                fresh = []
                for app in APPS:
                    status, body, seconds = await fresh_client.get(f"/{app}")
                    fresh.append(Answer(0, app, status, body, seconds))
                await fresh_client.close()
                await sup.refresh_state()
                check(Outcome(answers, fresh, old_pids, sup))
            finally:
                for client in [*keepers, *(c for cs in held.values() for c in cs)]:
                    await client.close()
                for node in vanished:
                    node.close()


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
    await drain_under_old_workers(rundir, guard=True, generations=2, check=_check_protected, supervise=the_daemon)


async def test_incident_control_through_the_daemon_without_guard(rundir):
    await drain_under_old_workers(
        rundir, guard=False, generations=1, check=_check_unprotected, rounds=1, supervise=the_daemon
    )
