"""End to end with the real HAProxy: a rolling deployment through template slots at runtime,
without a 503 or a reload.

The control shows the failure the order prevents on the binary the tests run: a rolling
deployment driven address-first gives 503s under load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import replace

import pytest

from rigs.runtime_rig import PLACEHOLDER, Rig, failed_log_lines, pods, rendered_of, running_rig, under_load
from rigs.wholes import plan_runtime_apply
from supervisor.effective import build_effective
from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime import apply as apply_module
from supervisor.haproxy.runtime.apply import apply_changes
from supervisor.haproxy.runtime.plan import ServerChange

pytestmark = pytest.mark.haproxy


# ---------------------------------------------------------------- rolling deployment through template slots

GROUPS = 6  # server-template lines of 2 slots each
LIVE = 3  # lines in service at any time
STEPS = 100  # each: one line (2 slots) disabled, one (2 slots) enabled -> 200 disables, 200 enables


def rolling_body(assignment: list[int | None]) -> str:
    lines = ["", "backend app", "    balance roundrobin"]
    for i, port in enumerate(assignment, start=1):
        where = f"127.0.0.1:{port}" if port is not None else f"{PLACEHOLDER} disabled"
        lines.append(f"    server-template g{i}_ 1-2 {where} check inter 300ms")
    return "\n".join(lines) + "\n"


def initial_assignment(ports: list[int]) -> list[int | None]:
    return [ports[i % len(ports)] if i < LIVE else None for i in range(GROUPS)]


def rolling_deployment(ports: list[int], steps: int = STEPS) -> Iterator[list[int | None]]:
    """Assignments of backend ports to template lines: oldest out, a parked line in, each step."""
    assignment = initial_assignment(ports)
    live = list(range(LIVE))
    parked = list(range(LIVE, GROUPS))
    for step in range(steps):
        out, into = live.pop(0), parked.pop(0)
        assignment[out] = None
        assignment[into] = ports[step % len(ports)]
        live.append(into)
        parked.append(out)
        yield list(assignment)


def applied_counts(caplog: pytest.LogCaptureFixture) -> tuple[int, int, int]:
    """Servers changed, refused and not sent by the one in-place runtime apply logged since
    caplog was cleared."""
    (args,) = [r.args for r in caplog.records if r.msg.startswith("runtime apply to worker %d: %d servers changed")]
    assert isinstance(args, tuple)
    return args[1], args[2], args[3]


def addr_first(change: ServerChange) -> list[str]:
    """The order that opens the window (test only): address, then the state, as two commands."""
    target = f"{change.backend}/{change.server}"
    commands = []
    if change.address_changed:
        commands.append(f"set server {target} addr {change.to_address} port {change.to_port}")
    if change.was_enabled and not change.enabled:
        commands.append(f"set server {target} state maint")
    elif change.enabled and not change.was_enabled:
        commands.append(f"set server {target} state ready")
    return commands


async def roll(rig: Rig, ports: list[int], apply) -> int:
    slot_changes = 0
    for assignment in rolling_deployment(ports):
        slot_changes += await apply(rolling_body(assignment))
        await asyncio.sleep(0.005)  # traffic flows between steps, as between controller updates
    return slot_changes


def check_final_state(rig: Rig, ports: list[int]) -> None:
    final = list(rolling_deployment(ports))[-1]
    servers = rig.servers()
    for i, port in enumerate(final, start=1):
        for slot in (f"g{i}_1", f"g{i}_2"):
            s = servers[slot]
            if port is None:
                assert s.in_maint and s.port == 1, (slot, s)
            else:
                assert not s.in_maint and s.port == port, (slot, s)


async def test_rolling_deployment_through_slots_without_a_503_or_a_reload(rundir, caplog):
    caplog.set_level(logging.INFO, logger="supervisor.haproxy.runtime")
    with pods(4) as started:
        ports = [p.port for p in started]
        async with running_rig(rundir, rolling_body(initial_assignment(ports))) as rig:
            reloads, worker = rig.reloads(), rig.worker
            applied_slot_changes = 0

            async def apply(body: str) -> int:
                caplog.clear()
                assert await rig.apply_rendered(rendered_of(rig, body))
                changed, refused, skipped = applied_counts(caplog)
                assert refused == skipped == 0
                return changed

            async def work() -> None:
                nonlocal applied_slot_changes
                applied_slot_changes = await roll(rig, ports, apply)

            load = await under_load(rig, work)
            assert applied_slot_changes == 4 * STEPS  # 2 slots out, 2 slots in, each step
            assert rig.reloads() == reloads and rig.worker == worker, "runtime apply must not reload"
            check_final_state(rig, ports)
            assert rig.settings.haproxy.effective_config.read_text() == build_effective(
                rig.settings, rendered_of(rig, rolling_body(list(rolling_deployment(ports))[-1]))
            ).text
            lines = failed_log_lines(rig)
    assert load.statuses[503] == 0 and not lines, (load.statuses, lines[:5])
    assert set(load.statuses) == {200} and load.requests > 500, load.statuses


async def test_control_rolling_deployment_address_first_gives_503s(rundir, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(apply_module, "ordered_commands", addr_first)
    with pods(4) as started:
        ports = [p.port for p in started]
        async with running_rig(rundir, rolling_body(initial_assignment(ports))) as rig:

            async def apply(body: str) -> int:
                new = Config.parse(build_effective(rig.settings, rendered_of(rig, body)).text)
                changes = plan_runtime_apply(rig.generation.model, new)
                assert changes is not None
                result = await apply_changes(rig.cli, rig.worker, changes)
                assert result.ok, result.refused
                rig.generation = replace(rig.generation, model=new)
                return len(result.applied)

            async def work() -> None:
                await roll(rig, ports, apply)

            load = await under_load(rig, work)
            check_final_state(rig, ports)
            await asyncio.sleep(0.1)
            lines = failed_log_lines(rig)
    assert load.statuses[503] > 0, f"address-first should show the window: {load.statuses}"
    assert lines and all(" SC-- " in line for line in lines), (load.statuses, rig.logs.lines[:5])
