"""The daemon applies slot changes of a rolling deployment at runtime: the controller rewrites
the rendered config, the daemon turns each rewrite into ordered Runtime API commands, under
steady load, with zero 503s and no reload (the master's reload counter does not move).
The address-first control lives in tests/test_runtime_rolling_e2e.py."""

from __future__ import annotations

import pytest

from rigs.harness import free_port
from rigs.runtime_rig import HEAD, LogReceiver, daemon_applies_under_load, pods
from supervisor.haproxy.answers import parse_servers_state
from tests.test_runtime_rolling_e2e import initial_assignment as first_assignment
from tests.test_runtime_rolling_e2e import rolling_body, rolling_deployment

pytestmark = pytest.mark.haproxy

STEPS = 50  # each step parks one template line (2 slots) and fills another: 200 slot changes


async def test_daemon_rolls_slots_at_runtime_without_503_or_reload(make, rundir):
    front = free_port()
    logs = LogReceiver(rundir / "log.sock")
    try:
        with pods(4) as started:
            ports = [p.port for p in started]
            head = HEAD.format(log_socket=logs.path, front=front)
            d = make(head + rolling_body(first_assignment(ports)), {
                "reload": {"runtime_apply": True, "debounce_ms": 20, "min_interval_ms": 0},
            })
            d.start()
            await d.wait_generation(1)
            reloads_before = (await d.show_proc()).master.reloads
            texts = [head + rolling_body(assignment) for assignment in rolling_deployment(ports, STEPS)]
            load = await daemon_applies_under_load(d, front, texts)
            procs = await d.show_proc()
            final = list(rolling_deployment(ports, STEPS))[-1]
            worker = procs.current_worker.pid
            servers = {s.name: s for s in parse_servers_state(
                await d.cli.execute(f"@!{worker} show servers state app"))}
            failures = [line for line in logs.drain() if " 503 " in line]
    finally:
        logs.close()
    assert procs.master.reloads == reloads_before, "runtime apply must not reload"
    assert not procs.old_workers
    assert load.statuses[503] == 0 and not failures, (load.statuses, failures[:3])
    assert set(load.statuses) == {200} and load.requests > 200, load.statuses
    for i, port in enumerate(final, start=1):
        for slot in (f"g{i}_1", f"g{i}_2"):
            assert servers[slot].in_maint == (port is None), servers[slot]
            if port is not None:
                assert servers[slot].port == port
    assert d.log().count("reload runtime_applied") == STEPS


async def test_a_change_the_runtime_api_cannot_make_reloads_and_the_log_says_why(make, rundir):
    front = free_port()
    with pods(2) as (p1, p2):
        body = f"\nbackend app\n    server s1 {p1.address}\n"
        head = HEAD.format(log_socket=rundir / "log.sock", front=front)
        d = make(head + body, {"reload": {"runtime_apply": True, "debounce_ms": 20, "min_interval_ms": 0}})
        d.start()
        await d.wait_generation(1)
        # A parameter `set server` cannot set (servers added or removed: tests/test_membership_e2e.py).
        d.write(head + body.replace(p1.address, f"{p1.address} maxconn 10") + f"    server s2 {p2.address}\n")
        await d.wait_generation(2)
    (line,) = await d.wait_log(r"runtime apply not possible")
    assert line.endswith("runtime apply not possible, reloading: backend app: `server s1 <address> maxconn 10` "
                         "differs beyond what the Runtime API sets"), line
