"""Controller-socket mode end to end, the relay: the lines haproxytech's ingress controller writes
(rigs/controller.py) are replayed through the daemon's runtime socket under keep-alive
load, and the answers, map updates and out-of-service marks come through as HAProxy gives them.

The control sends the same lines straight to HAProxy's stats socket: the controller's
address-first disable shows the 503 `SC` window there.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from rigs.controller import add_map_payload, disable, enable, sync_line, wrap
from rigs.harness import KeepAliveClient
from rigs.sidecar import (
    controller_accepts,
    raise_fd_limit,
    reload_through_facade,
    replay,
    rolling_lines,
    roundtrip,
    sidecar,
    simultaneous,
    under_load,
    update_map,
)

pytestmark = pytest.mark.haproxy


STEPS = 1500  # more lines than the control ever needed for its first 503 (figures in the commit)
PAUSE_S = 0.002
# The control sends lines until the first 503.
CONTROL_MAX_LINES, CONTROL_MAX_S = 3000, 60


async def test_rolling_deployment_through_the_relay_gives_no_503(rundir):
    """Slots disabled and enabled through the relay, a map updated, and a reload through the
    facade halfway, as the controller does them, under keep-alive load."""
    async with sidecar(rundir) as s:
        first = rolling_lines(s, STEPS // 2)
        halfway = s.rendered()  # the config the controller writes for the slots it runs by then
        second = rolling_lines(s, STEPS - STEPS // 2)
        answers: list[bytes] = []
        reloaded = b""

        async def work() -> None:
            nonlocal reloaded
            answers.extend(await replay(s.runtime_socket, first, pause_s=PAUSE_S))
            answers.extend(await update_map(s, "/ halfway"))
            s.daemon.write(halfway)
            reloaded = await reload_through_facade(s)
            answers.extend(await replay(s.runtime_socket, second, pause_s=PAUSE_S))

        load = await under_load(s.front, work)
        await asyncio.sleep(0.1)
        failed = s.failed_lines()
        states = await s.servers_state()
        assert s.daemon.count("sent in a safe order") == STEPS
    assert reloaded.startswith(b"Success=1\n--\n"), reloaded
    assert load.statuses[503] == 0 and not failed, (load.statuses, failed[:3])
    assert set(load.statuses) == {200} and load.requests > 500, load.statuses
    assert all(controller_accepts(a) for a in answers), answers[:3]
    assert all(a.startswith(b"\n") for a in answers), answers[:3]  # set severity-output's answer first
    for name, pod in s.slots.items():
        assert states[name] == ((pod.address, "ready") if pod else ("127.0.0.1:1", "maint")), states


async def test_control_the_same_lines_straight_to_haproxy_give_503_sc(rundir):
    """The window between the two commands of a disable is narrow: the lines go round until
    HAProxy logs a failed request, bounded in count and in time."""
    async with sidecar(rundir) as s:
        sent = 0

        async def work() -> None:
            nonlocal sent
            deadline = time.monotonic() + CONTROL_MAX_S
            while sent < CONTROL_MAX_LINES and time.monotonic() < deadline and not s.failed_lines():
                await replay(s.stats_socket, rolling_lines(s, 20), pause_s=PAUSE_S)
                sent += 20

        load = await under_load(s.front, work)
        await asyncio.sleep(0.1)
        failed = s.failed_lines()
    assert load.statuses[503] > 0, f"the controller's order should show the window: {load.statuses}, {sent} lines"
    assert failed and all(" SC-- " in line for line in failed), failed[:3]


async def test_answers_read_as_haproxy_gives_them_in_the_controller_order(rundir):
    """The relay's answer to a reordered line is HAProxy's answer to the line as written."""
    async with sidecar(rundir) as s:
        # An unknown server first: its error is what client-native's check reads.
        line = wrap(b"set server b/NOPE addr 127.0.0.1 port 1;" + disable("b", "SRV_1", port=1))
        via_relay = await roundtrip(s.runtime_socket, line)
        await roundtrip(s.stats_socket, wrap(enable("b", "SRV_1", "127.0.0.1", s.pods[0].port)))
        straight = await roundtrip(s.stats_socket, line)
        assert s.daemon.count("sent in a safe order") == 1
    assert via_relay == straight, (via_relay, straight)
    assert via_relay.startswith(b"\n[3]: No such server.\n"), via_relay
    assert not controller_accepts(via_relay)


async def test_map_update_passes_byte_for_byte(rundir):
    async with sidecar(rundir) as s:
        prepared = await roundtrip(s.runtime_socket, wrap(f"prepare map {s.map_path}".encode()))
        m = re.search(rb"New version created: (\d+)", prepared)
        assert m, prepared
        version = m[1].decode()
        added = await roundtrip(s.runtime_socket, add_map_payload(version, str(s.map_path), "/ new\n/a alpha"))
        committed = await roundtrip(s.runtime_socket, wrap(f"commit map @{version} {s.map_path}".encode()))
        shown = (await roundtrip(s.stats_socket, f"show map {s.map_path}\n".encode())).decode()
        client = await KeepAliveClient(s.front).connect()
        try:
            status, _, _ = await client.get("/a")
        finally:
            await client.close()
        assert s.daemon.count("sent in a safe order") == 0
    assert (added, committed) == (b"\n\n", b"\n\n"), (added, committed)
    assert re.findall(r"\S+ (\S+ \S+)", shown) == ["/ new", "/a alpha"], shown
    assert status == 200


async def test_out_of_service_marks_the_server_dead_for_old_workers(rundir):
    async with sidecar(rundir, {"old_workers": {"guard": True}}) as s:
        status_sock = s.daemon.directory / "status.sock"

        async def operator_dead() -> str:
            reader, writer = await asyncio.open_unix_connection(str(status_sock))
            writer.write(b"GET /status HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n")
            answer = (await reader.read()).decode()
            writer.close()
            return answer

        await roundtrip(s.runtime_socket, sync_line(disable("b", "SRV_1", port=1)))
        marked = await operator_dead()
        await roundtrip(s.runtime_socket, sync_line(enable("b", "SRV_1", "127.0.0.1", s.pods[0].port)))
        unmarked = await operator_dead()
    assert "b/SRV_1" in marked, marked[-2000:]
    assert "b/SRV_1" not in unmarked, unmarked[-2000:]


# ---------------------------------------------------------------- many callers at once

CALLERS = 1000


def spare_disables(s, count: int) -> list[bytes]:
    """The controller's disable of the free slots (SRV_3, SRV_4: in maint already), a line
    the relay reorders into three connections to HAProxy."""
    return [sync_line(disable("b", f"SRV_{3 + i % 2}", port=1)) for i in range(count)]


async def test_a_thousand_callers_at_once_lose_no_line(rundir):
    """However many callers connect at once, the relay queues them for HAProxy's socket
    (maxconn 10): each gets HAProxy's own answer, none a `Connection lost`."""
    raise_fd_limit(4 * CALLERS + 512)
    async with sidecar(rundir) as s:
        lines = spare_disables(s, CALLERS // 2) + [wrap(b"show info")] * (CALLERS // 2)
        through = await simultaneous(s.runtime_socket, lines)
        log = s.daemon.run_log()
        states = await s.servers_state()
    assert through.lost == 0, (through.errors, [a for a in through.answers if a is None or b"supervisor" in a][:3])
    answers = [a for a in through.answers if a is not None]
    assert all(controller_accepts(a) and a.startswith(b"\n") for a in answers), answers[:3]
    assert sum(b"\nName: HAProxy\n" in a for a in answers) == CALLERS // 2
    assert "Invalid argument" not in log, log[-3000:]
    assert states["SRV_3"] == ("127.0.0.1:1", "maint") and states["SRV_1"] == (s.pods[0].address, "ready")


async def test_a_caller_that_waits_past_the_bound_gets_one_error_line(rundir):
    """With HAProxy's socket held by an idle session and a short queue bound, the next line
    is answered `[3]:` in the controller's form and never sent."""
    settings = {"controller": {"queue_timeout_s": 0.5}, "haproxy": {}}
    async with sidecar(rundir, settings) as s:
        s.daemon.write(s.rendered().replace("mode 600 level admin", "mode 600 level admin maxconn 1"))
        await s.daemon.wait_log(r"reload ok")
        reader, writer = await asyncio.open_unix_connection(s.runtime_socket)
        writer.write(b"prompt\n")  # an interactive session: holds HAProxy's one connection
        await writer.drain()
        await reader.readuntil(b"> ")
        waited = await roundtrip(s.runtime_socket, sync_line(disable("b", "SRV_3", port=1)))
        writer.close()
        after = await roundtrip(s.runtime_socket, sync_line(disable("b", "SRV_3", port=1)))
    assert re.fullmatch(rb"\n\[3\]: haproxy-supervisor: waited 0\.5s for one of HAProxy's 1 runtime connections\n\n",
                        waited), waited
    assert controller_accepts(after) and after.startswith(b"\n"), after


async def test_idle_connections_close_after_the_idle_timeout(rundir):
    async with sidecar(rundir, {"controller": {"idle_timeout_s": 1}}) as s:
        closed = {}
        for name, path in (("runtime", s.runtime_socket), ("master", s.master_socket)):
            for first in (b"", b"prompt\n"):  # nothing sent; an interactive session left idle
                reader, writer = await asyncio.open_unix_connection(path)
                writer.write(first)
                began = time.monotonic()
                async with asyncio.timeout(10):
                    while await reader.read(65536):
                        pass
                closed[name, first] = time.monotonic() - began
                writer.close()
    assert all(0.9 < seconds < 5 for seconds in closed.values()), closed


async def test_long_lines_are_reordered_or_refused_with_one_line(rundir):
    async with sidecar(rundir) as s:
        # 400 pairs (29 KB): past HAProxy's own 16 KiB line, each command is still sent alone
        pairs = [disable("b", f"SRV_{3 + i % 2}", port=1) for i in range(400)]
        long_answer = await roundtrip(s.runtime_socket, sync_line(*pairs))
        too_long = await roundtrip(s.runtime_socket, sync_line(*pairs * 40))  # past the relay's 1 MiB
        reordered = s.daemon.count("sent in a safe order")
    assert len(sync_line(*pairs)) > 16384 and len(sync_line(*pairs * 40)) > 1 << 20
    assert reordered == 1
    assert controller_accepts(long_answer) and b"[3]" not in long_answer, long_answer[:200]
    assert too_long == b"[3]: haproxy-supervisor: a line longer than 1048576 bytes is refused\n\n", too_long[:200]
