"""Fault: a second `run` on the same settings (the same runtime_dir).

Two daemons used to start two HAProxy masters whose workers shared the frontend port, each
talking to the other's workers; one's clean-up removed the other's `haproxy -c` copy. Now the
daemon holds an exclusive lock on runtime_dir for its whole life: a second `run` exits 2 with
one line naming the PID that holds it, and touches none of the first one's files.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rigs.daemon import Daemon, http_get
from rigs.harness import ROOT
from supervisor.master.processes import find_masters
from supervisor.settings import load_settings
from tests.support.faults import serving

pytestmark = pytest.mark.haproxy


def second_run(d: Daemon, log: Path) -> subprocess.Popen[bytes]:
    """`run` on the first daemon's settings file, its output into `log`."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PATH"] = env.get("PATH", "") + ":/usr/sbin"
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "--config", str(d.settings_path)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
        )


async def first_exit(procs: list[subprocess.Popen[bytes]], timeout: float) -> subprocess.Popen[bytes] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                return proc
        await asyncio.sleep(0.05)
    return None


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def masters_of(d: Daemon) -> set[int]:
    """The HAProxy masters holding this runtime_dir's master socket (process facts, any version)."""
    return set(find_masters(load_settings(d.settings_path)))


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file in runtime_dir: (inode, mtime_ns)."""
    return {p.name: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in directory.iterdir()}


async def test_a_second_run_beside_a_serving_daemon_exits_2_and_touches_nothing(make):
    async with serving(make) as node:
        d = node.daemon
        # A `haproxy -c` copy of the first daemon's, as during a check.
        checking = d.runtime / f".validate.{d.pid}.a1b2c3.cfg"
        checking.write_text("global\n")
        await asyncio.sleep(1.2)  # past a housekeeping round: its writes are done
        before = snapshot(d.runtime)
        masters = masters_of(d)
        log = d.directory / "second.log"
        other = second_run(d, log)
        try:
            exited = await first_exit([other], timeout=20)
        finally:
            stop(other)
        # `check` and `render` beside it: they read, and remove only their own check copy.
        for command in ("check", "render"):
            done = subprocess.run(
                [sys.executable, "-m", "supervisor", command, "--config", str(d.settings_path)],
                capture_output=True, text=True, cwd=ROOT, timeout=30, check=False,
                env={**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin"},
            )
            assert done.returncode == 0, done.stderr
        after = snapshot(d.runtime)
        masters_after = masters_of(d)
        await asyncio.sleep(0.5)
    out = log.read_text().strip()
    print(f"second run: exit {other.returncode}: {out!r}")
    assert exited is other, f"the second run kept running\n{out}"
    assert other.returncode == 2, out
    lines = out.splitlines()
    assert len(lines) == 1 and f"PID {d.pid}" in lines[0] and str(d.runtime) in lines[0], lines
    assert len(masters) == 1 and masters_after == masters, (masters, masters_after)
    assert checking.exists(), "the first daemon's check copy was removed"
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                             if before.get(k) != after.get(k)}
    assert not node.loop.failures, node.loop.failures[:5]
    assert set(node.tags()) == {"v1"}
    assert d.count("Traceback") == 0


async def test_two_runs_started_at_once_make_one_master(make):
    async with serving(make) as node:
        d = node.daemon
        d.signal(signal.SIGTERM)  # the first daemon stops with its HAProxy: the two race on a clean slate
        assert await d.wait_exit() == 0
        log = d.directory / "second.log"
        d.start()
        other = second_run(d, log)
        assert d.proc is not None
        try:
            loser = await first_exit([d.proc, other], timeout=30)
            winner = other if loser is d.proc else d.proc
            served = 0
            deadline = time.monotonic() + 20
            while served < 20 and time.monotonic() < deadline:
                status, headers, _ = await http_get(node.front, timeout=2)
                served += status == 200 and headers.get("x-tag") == "v1"
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a second master, if any, has had time to start
            masters = masters_of(d)
            still_running = winner.poll() is None
        finally:
            stop(other)
    out = log.read_text().strip() if loser is other else d.run_log()
    print(f"loser exit {loser.returncode if loser else None}: {out.splitlines()[-1:]!r}; masters {masters}")
    assert loser is not None, "both runs kept running"
    assert loser.returncode == 2, out
    assert f"PID {winner.pid}" in out, out
    assert still_running and served == 20
    assert len(masters) == 1, masters
