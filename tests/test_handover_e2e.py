"""Make before break against the real binary: one live slot hands over to another slot in the
same config write, 40 times under steady keep-alive load, with no reload.

Enables complete before any disable begins, so the backend always has a server: 0 non-200.
The control sends the same changes step-synchronously (step 0 of every server together), as
the runtime apply did before: the outgoing slot's `state maint` lands before the incoming
slot's `state ready`, HAProxy logs `backend 'app' has no server available!`, clients get 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest

from rigs.harness import free_port
from rigs.runtime_rig import (
    HEAD,
    PLACEHOLDER,
    LogReceiver,
    Rig,
    daemon_applies_under_load,
    failed_log_lines,
    pods,
    rendered_of,
    running_rig,
    under_load,
)
from rigs.wholes import plan_runtime_apply
from supervisor.effective import build_effective
from supervisor.haproxy.config import Config
from tests.test_make_before_break import step_synchronous
from tests.test_runtime_rolling_e2e import applied_counts

pytestmark = pytest.mark.haproxy

SLOTS = 4
HANDOVERS = 40
WRITE_INTERVAL_S = 0.3
# A bound on the load, far above what 4 clients send in the 12 s of hand-overs: the load runs
# through all of them (each test asserts it was not cut short).
MAX_REQUESTS = 400_000


def handover_body(live: int, port: int) -> str:
    """Ingress-style slots SRV_1..SRV_4 with checks; only slot `live` is in service."""
    lines = ["", "backend app", "    balance roundrobin", "    default-server check inter 300ms"]
    for slot in range(1, SLOTS + 1):
        where = f"127.0.0.1:{port}" if slot == live else f"{PLACEHOLDER} disabled"
        lines.append(f"    server SRV_{slot} {where}")
    return "\n".join(lines) + "\n"


def handovers(ports: list[int]) -> list[str]:
    """Each write moves the one live slot to the next slot, and the replica to the next pod."""
    return [handover_body(step % SLOTS + 1, ports[step % len(ports)]) for step in range(1, HANDOVERS + 1)]


async def hand_over(rig: Rig, ports: list[int], apply: Callable[[str], Awaitable[None]]):
    async def work() -> None:
        for body in handovers(ports):
            await apply(body)
            await asyncio.sleep(WRITE_INTERVAL_S)

    return await under_load(rig, work, max_requests=MAX_REQUESTS)


async def test_a_live_slot_hands_over_40_times_without_a_non_200_or_a_reload(rundir, caplog):
    caplog.set_level(logging.INFO, logger="supervisor.haproxy.runtime")
    with pods(2) as started:
        ports = [p.port for p in started]
        async with running_rig(rundir, handover_body(1, ports[0])) as rig:
            reloads, worker = rig.reloads(), rig.worker

            async def apply(body: str) -> None:
                caplog.clear()
                assert await rig.apply_rendered(rendered_of(rig, body))
                assert applied_counts(caplog) == (2, 0, 0)

            load = await hand_over(rig, ports, apply)
            assert rig.reloads() == reloads and rig.worker == worker, "runtime apply must not reload"
            servers = rig.servers()
            lines = failed_log_lines(rig)
    final_live = HANDOVERS % SLOTS + 1
    assert [not servers[f"SRV_{slot}"].in_maint for slot in range(1, SLOTS + 1)] == [
        slot == final_live for slot in range(1, SLOTS + 1)
    ], servers
    print(f"hand-over, make before break: {dict(load.statuses)}")
    assert set(load.statuses) == {200} and not lines, (load.statuses, lines[:3])
    assert 500 < load.requests < MAX_REQUESTS, load.statuses


async def test_control_step_synchronous_handover_gives_503s(rundir):
    with pods(2) as started:
        ports = [p.port for p in started]
        async with running_rig(rundir, handover_body(1, ports[0])) as rig:

            async def apply(body: str) -> None:
                new = Config.parse(build_effective(rig.settings, rendered_of(rig, body)).text)
                changes = plan_runtime_apply(rig.generation.model, new)
                assert changes is not None and len(changes) == 2
                refused = await step_synchronous(rig.cli, rig.worker, changes)
                assert not refused, refused
                rig.generation = replace(rig.generation, model=new)

            load = await hand_over(rig, ports, apply)
            await asyncio.sleep(0.1)
            lines = failed_log_lines(rig)
    print(f"hand-over, step-synchronous: {dict(load.statuses)}")
    assert load.requests < MAX_REQUESTS, load.statuses
    assert load.statuses[503] > 0, f"step-synchronous hand-over should leave the backend empty: {load.statuses}"
    assert lines, "no 503 logged"


async def test_the_daemon_hands_over_on_config_writes_without_a_non_200_or_a_reload(make, rundir):
    """The same hand-overs as written by a controller: the rendered file rewritten every 0.3 s."""
    front = free_port()
    logs = LogReceiver(rundir / "log.sock")
    try:
        with pods(2) as started:
            ports = [p.port for p in started]
            head = HEAD.format(log_socket=logs.path, front=front)
            d = make(head + handover_body(1, ports[0]), {
                "reload": {"runtime_apply": True, "debounce_ms": 20, "min_interval_ms": 0},
            })
            d.start()
            await d.wait_generation(1)
            reloads_before = (await d.show_proc()).master.reloads
            texts = [head + body for body in handovers(ports)]
            load = await daemon_applies_under_load(d, front, texts, WRITE_INTERVAL_S, MAX_REQUESTS)
            procs = await d.show_proc()
            failures = [line for line in logs.drain() if " 503 " in line]
    finally:
        logs.close()
    print(f"hand-over through the daemon: {dict(load.statuses)}")
    assert procs.master.reloads == reloads_before and not procs.old_workers, "runtime apply must not reload"
    assert set(load.statuses) == {200} and not failures, (load.statuses, failures[:3])
    assert 500 < load.requests < MAX_REQUESTS, load.statuses
    assert d.log().count("reload runtime_applied") == HANDOVERS
