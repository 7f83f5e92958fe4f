"""End to end: what a daemon killed at a bad moment leaves behind is tidied, and costs no reload.

- `.validate.*.cfg` copies of a `haproxy -c` cut short by a kill are removed at start-up, and
  a copy whose maker still runs (a `check`) is not;
- after a kill between the reload and its bookkeeping (the new worker runs, generations.json
  does not know it), the next daemon adopts without one more reload; with watched files too,
  by the pending reload recorded before it was sent (control: without the record, one more).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rigs.daemon import one_backend, write_atomic
from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port
from supervisor.effective import load_effective
from supervisor.haproxy.answers import ProcList
from supervisor.haproxy.api import CLIError
from supervisor.settings import load_settings

pytestmark = pytest.mark.haproxy


async def test_copies_left_by_a_kill_during_haproxy_check_are_removed_at_start(make):
    front = free_port()
    with backends("b1") as started:
        d = make(config(front, started["b1"].address, "v1"))
        d.runtime.mkdir(mode=0o750, parents=True, exist_ok=True)
        dead_pid = subprocess.Popen([sys.executable, "-c", ""])  # a PID that no longer runs
        dead_pid.wait()
        left = [d.runtime / ".validate.k1ll3d.cfg", d.runtime / ".validate.x.cfg",
                d.runtime / f".validate.{dead_pid.pid}.a1b2c3.cfg"]
        for path in left:
            path.write_text("global\n")
        # A `check` running now (this test's PID stands for it) keeps its copy.
        checking = d.runtime / f".validate.{os.getpid()}.d4e5f6.cfg"
        checking.write_text("global\n")
        keep = d.runtime / "operator-notes.cfg"
        keep.write_text("# not ours to remove\n")
        d.start()
        await d.wait_generation(1)
    assert not any(path.exists() for path in left)
    assert keep.exists() and checking.exists()
    assert d.count(r"removed .*\.validate\..*\.cfg: left by a daemon killed during `haproxy -c`") == 3


async def test_adoption_after_a_kill_between_reload_and_bookkeeping_makes_no_reload(make):
    async with one_backend(make) as node:
        d, front, b1 = node.daemon, node.front, node.backend
        loop = node.requests(max_requests=3000, max_seconds=30)
        # The daemon goes (and HAProxy stays); then, as if it had been killed in the middle of a
        # reload: the new effective config on disk, HAProxy reloaded on it, nothing recorded.
        d.signal(signal.SIGQUIT)
        assert await d.wait_exit() == 3
        d.write(config(front, b1, "v2"))
        effective = load_effective(load_settings(d.settings_path))
        write_atomic(d.runtime / "haproxy.cfg", effective.text)
        before = await d.show_proc()
        with contextlib.suppress(CLIError):  # 2.6 closes the connection as the master re-executes
            await d.cli.execute("reload")
        for _ in range(100):
            await asyncio.sleep(0.05)
            with contextlib.suppress(CLIError):
                procs = await d.show_proc()
                if procs.current_worker is not None and procs.current_worker.pid != before.current_worker.pid:
                    break
        reloads = procs.master.reloads
        d.start()
        await d.wait_log(r"generations rebuilt")
        await asyncio.sleep(2.5)  # debounce, the check, and a reload if one were made
        results = await loop.stop()
        after = await d.show_proc()
    assert after.master.pid == before.master.pid
    assert after.master.reloads == reloads, d.run_log()
    assert d.count(r"reload ok") == 0
    assert not [r for r in results if r[0] != 200]
    assert results[-1] == (200, "v2")


LOAD_S = 1.5  # how long HAProxy (and its check) takes to load the config below: a kill lands mid-reload
SLOW_LUA = f"""\
-- Keeps HAProxy busy while it loads its config.
local started = os.clock()
while os.clock() - started < {LOAD_S} do end
"""


def pending_reload(runtime: Path) -> dict | None:
    try:
        return json.loads((runtime / "generations.json").read_text()).get("pending_reload")
    except (OSError, ValueError):
        return None


async def show_proc_once_answered(d, unlike_pid: int | None = None, timeout: float = 15) -> ProcList:
    """`show proc` once the master answers (its CLI is away while 2.6 re-executes), with a
    current worker other than `unlike_pid`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            procs = await d.show_proc()
        except (CLIError, OSError):
            procs = None
        if procs is not None and procs.current_worker is not None and procs.current_worker.pid != unlike_pid:
            return procs
        await asyncio.sleep(0.1)
    raise AssertionError(f"no answer from the master within {timeout}s")


@pytest.mark.parametrize("recorded", [True, False], ids=["pending-recorded", "control-record-removed"])
async def test_adoption_after_a_kill_mid_reload_with_watched_files_makes_no_reload(make, rundir, recorded):
    lua = rundir / "slow.lua"
    lua.write_text(SLOW_LUA)
    # A loaded machine stretches the slow load several times over: the control's reload must
    # not time out.
    settings = {"haproxy": {"watch": [str(lua)]}, "reload": {"timeout_s": 60}}
    async with one_backend(make, settings) as node:
        d, front, b1 = node.daemon, node.front, node.backend
        loop = node.requests(max_requests=3000, max_seconds=40)
        before = await d.show_proc()
        d.write(config(front, b1, "v2").replace("global\n", f"global\n    lua-load {lua}\n", 1))
        deadline = time.monotonic() + 15
        while pending_reload(d.runtime) is None:  # recorded once `haproxy -c` passed, just before `reload`
            assert time.monotonic() < deadline, d.run_log()
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # sent; HAProxy loads for LOAD_S
        d.kill9()
        procs = await show_proc_once_answered(d, before.current_worker.pid)
        if not recorded:
            index = d.runtime / "generations.json"
            doc = json.loads(index.read_text())
            doc["pending_reload"] = None
            write_atomic(index, json.dumps(doc))
        reloads = procs.master.reloads
        d.start()
        await d.wait_log(r"generations rebuilt")
        if recorded:
            with contextlib.suppress(TimeoutError):  # a reload, if one is made, checks and loads for LOAD_S each
                await d.wait_log(r"reload ok", timeout=6 * LOAD_S + 2)
        else:  # the control makes one: wait for it, however loaded the machine
            await d.wait_log(r"reload ok", timeout=60)
        results = await loop.stop()
        after = await show_proc_once_answered(d)
    assert after.master.pid == before.master.pid
    assert not [r for r in results if r[0] != 200]
    assert results[-1] == (200, "v2")
    if recorded:
        assert after.master.reloads == reloads, d.run_log()
        assert d.count(r"reload ok") == 0
        assert d.count(r"started by the reload sent before the daemon stopped") == 1
    else:  # the control: what the new worker loaded is unknown, and a reload makes sure
        assert after.master.reloads == reloads + 1, d.run_log()
        assert d.count(r"reload ok") == 1
