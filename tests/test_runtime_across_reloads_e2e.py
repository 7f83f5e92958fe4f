"""End to end with the real HAProxy: server state set at runtime across reloads.

The controls show each failure the module prevents on the binary the tests run: a maint server
comes back UP after a reload without the state file, and HAProxy's own state-file rules keep a
stale port or a stale maint that the filter drops.
"""

from __future__ import annotations

from collections import Counter

import pytest

from rigs.runtime_rig import PLACEHOLDER, STATEFUL, bodies_of, pods, rendered_of, running_rig

pytestmark = pytest.mark.haproxy


# ---------------------------------------------------------------- server state across reloads


@pytest.mark.parametrize("preserve", [True, False], ids=["with-state-file", "control-without"])
async def test_maint_server_stays_in_maint_across_a_reload(rundir, preserve):
    with pods(2) as (p1, p2):
        body = STATEFUL
        fmt = dict(s1=p1.address, s2=p2.address, slot=f"{PLACEHOLDER} disabled")
        async with running_rig(rundir, body, preserve_state=preserve, **fmt) as rig:
            # An operator's maint: nothing in the config says so.
            assert rig.master.command(f"@!{rig.worker} set server app/s2 state maint").strip() == ""
            old = rig.worker
            new = await rig.reload_rendered(rendered_of(rig, body, **fmt))
            assert new != old
            s2 = rig.servers(new)["s2"]
            seen = await bodies_of(rig.front, 8)
    if preserve:
        assert s2.in_maint, s2
        assert seen == Counter({(200, "pod0"): 8}), seen
    else:
        assert not s2.in_maint, "control: without the state file the new worker brings s2 back"
        assert seen[(200, "pod1")] > 0, seen


async def test_slots_parked_at_runtime_stay_parked_across_a_reload_and_come_back(rundir):
    with pods(3) as (p1, p2, p3):
        fmt = dict(s1=p1.address, s2=p2.address, slot=p3.address)
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            parked = dict(fmt, slot=f"{PLACEHOLDER} disabled")
            assert await rig.apply_rendered(rendered_of(rig, STATEFUL, **parked))
            # Another change needs a reload; the slots stay parked.
            reload_body = STATEFUL.replace("balance roundrobin", "balance leastconn")
            new = await rig.reload_rendered(rendered_of(rig, reload_body, **parked))
            slots = [rig.servers(new)[f"slot{i}"] for i in (1, 2)]
            assert all(s.in_maint and s.port == 1 for s in slots), slots
            assert (await bodies_of(rig.front, 6))[(200, "pod2")] == 0
            # Filled again at runtime in the new worker: they serve.
            assert await rig.apply_rendered(rendered_of(rig, reload_body, **fmt))
            slots = [rig.servers(new)[f"slot{i}"] for i in (1, 2)]
            assert all(not s.in_maint and s.port == p3.port for s in slots), slots
            seen = await bodies_of(rig.front, 12)
    assert seen[(200, "pod2")] > 0 and sum(n for (status, _), n in seen.items() if status != 200) == 0, seen


@pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "control-raw-state"])
async def test_reload_takes_addresses_and_enables_from_the_new_config(rundir, filtered):
    """HAProxy's own rules would keep a stale port and the maint this daemon set at runtime."""
    with pods(4) as (p1, p2, p3, p4):
        fmt = dict(s1=p1.address, s2=p2.address, slot=p3.address)
        async with running_rig(rundir, STATEFUL, **fmt) as rig:
            # The daemon parks the slots at runtime (forced maint in this worker) ...
            assert await rig.apply_rendered(rendered_of(rig, STATEFUL, **dict(fmt, slot=f"{PLACEHOLDER} disabled")))
            # ... then the next config fills them again at the same address, moves s1 to
            # another port, and changes something that needs a reload.
            body = STATEFUL.replace("balance roundrobin", "balance leastconn")
            moved = dict(fmt, s1=p4.address, s2=p2.address.replace("127.0.0.1", "127.0.0.2"))
            new = await rig.reload_rendered(rendered_of(rig, body, **moved), raw_state=not filtered)
            servers = rig.servers(new)
    s1, s2, slot1 = servers["s1"], servers["s2"], servers["slot1"]
    # An address written as an IP literal comes from the config either way.
    assert s2.address == "127.0.0.2" and s2.port == p2.port, s2
    if filtered:
        assert s1.port == p4.port, s1
        assert not slot1.in_maint, slot1
    else:
        assert s1.port == p1.port, "control: HAProxy takes srv_port from the state file over the config"
        assert slot1.in_maint, "control: HAProxy keeps the forced maint although the config enables the slot"
