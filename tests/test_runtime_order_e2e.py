"""End to end with the real HAProxy: the order of runtime server changes, and refused commands.

The control shows the failure the order prevents on the binary the tests run: a ready server
re-addressed to the placeholder answers 503 (SC in the log). A refused command leaves the others
applied, or the server in maint, and an old worker's refusal asks for a reload.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from rigs.harness import KeepAliveClient
from rigs.runtime_rig import PLACEHOLDER, STATEFUL, bodies_of, failed_log_lines, pods, rendered_of, running_rig
from supervisor.haproxy.runtime.apply import apply_changes
from supervisor.haproxy.runtime.plan import ServerChange

pytestmark = pytest.mark.haproxy


# ---------------------------------------------------------------- control: the window is real


TWO_SERVERS = """
backend app
    balance roundrobin
    server s1 {s1}
    server s2 {s2}
"""


async def test_control_readdressed_ready_server_answers_503_with_sc(rundir):
    with pods(2) as (p1, p2):
        async with running_rig(rundir, TWO_SERVERS, s1=p1.address, s2=p2.address) as rig:
            answer = rig.master.command(f"@!{rig.worker} set server app/s1 addr 127.0.0.1 port 1")
            assert "port changed from" in answer, answer
            statuses = Counter()
            for _ in range(6):  # roundrobin: every other request is balanced to s1
                client = await KeepAliveClient(rig.front).connect()
                status, _, _ = await client.get(timeout=5)
                statuses[status] += 1
                await client.close()
            await asyncio.sleep(0.1)
            lines = failed_log_lines(rig)
    assert statuses[503] >= 2 and statuses[200] >= 2, statuses
    assert lines, "no 503 logged"
    for line in lines:
        # server s1, connect time -1, termination SC, 3 retries on the same server
        assert " app/s1 " in line and " SC-- " in line and "/-1/" in line and "/3 " in line, line


async def test_maint_first_disable_of_the_same_server_loses_nothing(rundir):
    with pods(2) as (p1, p2):
        async with running_rig(rundir, TWO_SERVERS, s1=p1.address, s2=p2.address) as rig:
            disable = ServerChange("app", "s1", "127.0.0.1", p1.port, "127.0.0.1", 1, enabled=False)
            result = await apply_changes(rig.cli, rig.worker, [disable])
            assert result.ok and result.applied == [disable], result
            statuses = Counter()
            for _ in range(6):
                client = await KeepAliveClient(rig.front).connect()
                status, body, _ = await client.get(timeout=5)
                statuses[(status, body)] += 1
                await client.close()
            state = rig.servers()["s1"]
    assert statuses == Counter({(200, "pod1"): 6}), statuses
    assert state.in_maint and state.port == 1


# ---------------------------------------------------------------- refused commands


async def test_unknown_server_is_refused_and_others_still_apply(rundir, caplog):
    caplog.set_level(logging.WARNING, logger="supervisor.haproxy.runtime")
    with pods(3) as (p1, p2, p3):
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            ghost = ServerChange("app", "ghost", "127.0.0.1", 1, "127.0.0.1", p3.port, was_enabled=False)
            slot = ServerChange("app", "slot1", "127.0.0.1", 1, "127.0.0.1", p3.port, was_enabled=False)
            result = await apply_changes(rig.cli, rig.worker, [ghost, slot])
            servers = rig.servers()
    assert result.applied == [slot] and [r.change for r in result.refused] == [ghost]
    refused = result.refused[0]
    assert refused.command == "set server app/ghost state maint" and not refused.left_in_maint
    assert not servers["slot1"].in_maint and servers["slot1"].port == p3.port
    assert any("'set server app/ghost state maint': No such server." in r.getMessage() for r in caplog.records)


async def test_refusal_mid_sequence_leaves_the_server_in_maint(rundir, caplog):
    """A static balance algorithm refuses the weight: `state ready` is never sent."""
    caplog.set_level(logging.WARNING, logger="supervisor.haproxy.runtime")
    body = STATEFUL.replace("balance roundrobin", "balance source")
    with pods(3) as (p1, p2, p3):
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, body, **fmt) as rig:
            enable = ServerChange(
                "app", "slot1", "127.0.0.1", 1, "127.0.0.1", p3.port, to_weight=50, was_enabled=False
            )
            hostname = ServerChange("app", "s2", "127.0.0.1", p2.port, "nosuch.invalid", 80)
            result = await apply_changes(rig.cli, rig.worker, [enable, hostname])
            servers = rig.servers()
            seen = await bodies_of(rig.front, 10)
    assert result.applied == [] and len(result.refused) == 2
    weight, addr = result.refused
    assert weight.command == "set server app/slot1 weight 50"
    assert weight.left_in_maint and servers["slot1"].in_maint and servers["slot1"].port == p3.port
    assert addr.command == "set server app/s2 addr nosuch.invalid port 80"
    # A live server's address is swapped in place (make before break): refused, it serves on as it was.
    assert not addr.left_in_maint and not servers["s2"].in_maint and servers["s2"].port == p2.port
    assert sum(seen.values()) == 10 and set(seen) <= {(200, "pod0"), (200, "pod1")}, seen
    messages = [r.getMessage() for r in caplog.records]
    assert any("app/slot1" in m and "left in maint" in m for m in messages), messages
    assert any("'set server app/slot1 weight 50': " in m and "static LB algorithm" in m for m in messages), messages
    assert any("'set server app/s2 addr nosuch.invalid port 80': Invalid addr" in m for m in messages), messages


async def test_old_worker_refuses_and_the_hook_asks_for_a_reload(rundir, caplog):
    caplog.set_level(logging.WARNING, logger="supervisor.haproxy.runtime")
    with pods(3) as (p1, p2, p3):
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            old = rig.worker
            slow = await KeepAliveClient(rig.front).connect()
            try:
                in_flight = asyncio.create_task(slow.get("/slow?ms=3000", timeout=10))
                await asyncio.sleep(0.2)
                new = rig.master.reload()
                assert old in rig.master.worker_pids()[1], "the first worker should be draining"
                # A generation that still points at the old worker, as after a missed reload.
                enable = rendered_of(rig, STATEFUL, **dict(fmt, slot=p3.address))
                applied = await rig.apply_rendered(enable)
                old_slot = rig.servers(old)["slot1"]
                new_slot = rig.servers(new)["slot1"]
                await in_flight
            finally:
                await slow.close()
    refusals = [r.getMessage() for r in caplog.records if "Proxy is disabled." in r.getMessage()]
    assert applied is False and len(refusals) == 2
    assert all("state maint': Proxy is disabled." in m for m in refusals), refusals  # nothing after the maint
    assert rig.applier.forget == {"app/slot1", "app/slot2"}
    assert old_slot.in_maint and old_slot.port == 1 and new_slot.in_maint and new_slot.port == 1


async def test_hook_answers_false_for_a_change_that_needs_a_reload(rundir, caplog):
    caplog.set_level(logging.INFO, logger="supervisor.haproxy.runtime")
    with pods(2) as (p1, p2):
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            before = rig.generation.model.render()
            # A parameter `set server` cannot set (servers added or removed: test_membership_e2e).
            changed = STATEFUL.replace("    server s2 {s2} check", "    server s2 {s2} maxconn 10 check")
            assert not await rig.apply_rendered(rendered_of(rig, changed, **fmt))
            assert rig.generation.model.render() == before
            # Comments only: nothing to do, no reload either.
            assert await rig.apply_rendered(rendered_of(rig, STATEFUL + "# regenerated\n", **fmt))
    assert not any(r.msg.startswith("runtime apply to worker") for r in caplog.records)
