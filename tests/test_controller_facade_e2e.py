"""Controller-socket mode end to end, the master socket facade: a reload through it runs the
daemon's cycle, a refused config answers as HAProxy does with its alerts, and the facade and the
relay answer soon after a daemon restart."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest

from supervisor.haproxy.answers import ProcList
from tests.support.controller import disable, sync_line
from tests.support.harness import KeepAliveClient
from tests.support.sidecar import controller_accepts, reload_through_facade, roundtrip, sidecar

pytestmark = pytest.mark.haproxy


# ---------------------------------------------------------------- the master socket facade


def pid_of(procs: ProcList) -> int:
    worker = procs.current_worker
    assert worker is not None, procs
    return worker.pid


async def test_reload_through_the_facade_runs_the_daemons_cycle(rundir):
    # The watcher would apply each write only after 10 s: what happens next is the facade's doing.
    async with sidecar(rundir, {"reload": {"runtime_apply": True, "debounce_ms": 10000, "max_delay_ms": 20000}}) as s:
        before = await s.daemon.show_proc()
        # A slot filled: servers only, so the cycle applies it at runtime, in the same worker.
        s.slots["SRV_3"] = s.pods[2]
        s.daemon.write(s.rendered())
        applied = await reload_through_facade(s)
        middle = await s.daemon.show_proc()
        states = await s.servers_state()
        # A line beyond servers: the cycle reloads.
        s.daemon.write(s.rendered().replace("    retries 1\n", "    retries 2\n"))
        reloaded = await reload_through_facade(s)
        after = await s.daemon.show_proc()
        # other commands on the line: answered by the master, in their place
        listed_then_reloaded = await roundtrip(s.master_socket, b"show proc;reload;quit\n", timeout=20)
        helped = await roundtrip(s.master_socket, b"set severity-output number;help;quit\n")
        info = await roundtrip(s.master_socket, b"@1 set severity-output number;@1 show info;quit\n")
        log = s.daemon.run_log()
    assert applied.startswith(b"Success=1\n--\n") and b"applied at runtime" in applied, f"{applied!r}\n{log}"
    assert pid_of(middle) == pid_of(before), "a change of servers only is no reload"
    assert states["SRV_3"] == (s.pods[2].address, "ready"), states
    assert reloaded.startswith(b"Success=1\n--\n") and b"reloaded" in reloaded, reloaded
    assert pid_of(after) != pid_of(before)
    assert b"[ALERT]" not in applied + reloaded
    assert listed_then_reloaded.startswith(b"#") and b"\nSuccess=1\n--\n" in listed_then_reloaded, listed_then_reloaded
    assert "controller master socket" in log
    assert b"help" in helped and b"show proc" in helped, helped[:300]  # the master's own list
    assert re.search(rb"\nVersion: \d+\.\d+", info), info[:200]


async def test_refused_config_answers_success_0_with_haproxys_alerts(rundir):
    async with sidecar(rundir) as s:
        before = await s.daemon.show_proc()
        s.daemon.write(s.rendered().replace("    balance roundrobin", "    balance roundrobin\n    bogus_keyword"))
        answer = await reload_through_facade(s)
        after = await s.daemon.show_proc()
        client = await KeepAliveClient(s.front).connect()
        try:
            status, _, _ = await client.get()
        finally:
            await client.close()
    assert answer.startswith(b"Success=0\n--\n"), answer
    assert re.search(rb"\[ALERT\].*bogus_keyword", answer), answer
    assert pid_of(after) == pid_of(before)
    assert status == 200  # the last good config serves


async def test_facade_and_relay_answer_within_a_second_of_a_daemon_restart(rundir):
    async with sidecar(rundir) as s:
        s.daemon.signal(signal.SIGQUIT)  # the daemon exits, HAProxy stays for the next one to adopt
        assert await s.daemon.wait_exit() == 3
        s.daemon.start()
        started = time.monotonic()
        deadline = started + 5
        while True:
            try:
                info = await roundtrip(s.master_socket, b"@1 set severity-output number;@1 show info;quit\n", 5)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline, "the facade did not come back"
                await asyncio.sleep(0.02)
        answered_s = time.monotonic() - started
        disabled = await roundtrip(s.runtime_socket, sync_line(disable("b", "SRV_1", port=1)))
        s.slots["SRV_1"] = None  # the controller writes its config as it runs it, then reloads
        s.daemon.write(s.rendered())
        answer = await reload_through_facade(s)
        states = await s.servers_state()
        log = s.daemon.run_log()
    # Bound before HAProxy is adopted; the time includes the interpreter's start on a shared host.
    assert log.index("controller master socket") < log.index("haproxy-supervisor starting"), log[-2000:]
    assert answered_s < 3.0, answered_s
    assert re.search(rb"\nVersion: \d+\.\d+", info), info[:200]
    assert controller_accepts(disabled), disabled
    assert answer.startswith(b"Success=1\n--\n"), answer
    assert states["SRV_1"] == ("127.0.0.1:1", "maint"), states
