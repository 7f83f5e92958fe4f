"""The Ray bridge end to end: the real daemon, real HAProxy (master-worker), real backends, and
the bridge run exactly as Ray Serve's HAProxyManager runs its HAProxy (rigs/ray_driver.py):
Ray's argv forms, `show info` polled on admin.sock every 0.5 s until `Pid:` is the spawned PID,
SIGUSR1 to the old PID after a new one is ready, SIGKILL on stop. Configs are Ray-shaped, on
127.0.0.1 ports. Real Ray on top: the raysuite tests.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rigs.daemon import RequestLoop, http_get
from rigs.harness import KeepAliveClient, backends, free_port, haproxy_binary, port_open
from rigs.ray_driver import (
    App,
    RayManager,
    has_prometheus_exporter,
    pid_of_show_info,
    ray_config,
    send_socket_command,
)
from tests.support.ray_node import ray_node, sha, wait_until

pytestmark = pytest.mark.haproxy

# ---------------------------------------------------------------- start, reload, relay


async def test_ray_starts_and_reloads_through_the_bridge(rundir: Path):
    async with ray_node(rundir) as node:
        manager = node.manager()
        first = node.config("r1")
        spawn = await manager.start(first)  # Ray's wait: `Pid:` on admin.sock is the spawned PID
        assert spawn.args[1:] == ["-db", "-f", str(manager.config_path), "-dR"]
        doc = await node.status()
        # Ready means the daemon's worker runs exactly this text, served already.
        assert doc["worker"]["rendered_sha256"] == sha(first)
        assert await node.get() == (200, "r1", "r1")
        master = doc["haproxy"]["master_pid"]
        worker = doc["worker"]["pid"]

        # Ray's `show info` is the bridge's PID; the worker's own socket says the worker's.
        info = await send_socket_command(manager.socket_path, "show info")
        assert pid_of_show_info(info) == spawn.pid
        assert "Name: HAProxy" in info and "Uptime_sec:" in info  # the rest is HAProxy's answer
        own = await send_socket_command(node.worker_socket, "show info")
        # Control: without the rewrite Ray would read the worker's PID and never see its spawn.
        assert pid_of_show_info(own) == worker != spawn.pid
        # Every other command is the worker's answer.
        stat = await send_socket_command(manager.socket_path, "show stat")
        assert stat.startswith("# pxname,svname,") and "a,SERVE_REPLICA_a-0," in stat
        # The hand-off's server is the daemon's: Ray, which counts these rows as its replicas,
        # does not see it; the worker's own answer has it.
        assert "_hs_current" not in stat
        assert "a,_hs_current," in await send_socket_command(node.worker_socket, "show stat")
        assert "_hs_current" not in await send_socket_command(manager.socket_path, "show servers state")
        assert await send_socket_command(manager.socket_path, "show backend") == await send_socket_command(
            node.worker_socket, "show backend"
        )
        # The daemon moved Ray's stats socket (haproxy.move_stats_socket): the effective config
        # binds runtime_dir's, and Ray's path is the bridge's.
        effective = (node.daemon.runtime / "haproxy.cfg").read_text()
        assert f"stats socket {node.worker_socket} mode 666 level admin expose-fd listeners" in effective
        assert str(manager.socket_path) not in effective

        # A replica added: Ray spawns again (-sf, -x); the daemon applies it at runtime.
        second = node.config("r1", "r2")
        inode = node.daemon.rendered.stat().st_ino
        reload = await manager.reload(second)
        # Handed over by a rename into place (a new inode), never written through.
        assert node.daemon.rendered.stat().st_ino != inode
        assert not [p.name for p in node.daemon.rendered.parent.iterdir() if p.name != "haproxy.cfg"]
        assert reload.args[5:] == ["-sf", str(spawn.pid), "-x", str(manager.socket_path)]
        assert manager.server_state_file.read_text().startswith("1\n# be_id be_name")  # Ray's save, relayed
        doc = await node.status()
        assert doc["worker"]["pid"] == worker and doc["worker"]["rendered_sha256"] == sha(second)
        assert doc["reloads"]["runtime_applied"] == 1
        assert {(await node.get())[1] for _ in range(6)} == {"r1", "r2"}

        # A change beyond servers: the daemon reloads; Ray's wait ends once the new worker runs it.
        third = node.config("r1", "r2", tag="r3")
        last = await manager.reload(third)
        doc = await node.status()
        assert doc["worker"]["pid"] != worker and doc["worker"]["rendered_sha256"] == sha(third)
        assert (await node.get())[2] == "r3"
        assert pid_of_show_info(await send_socket_command(manager.socket_path, "show info")) == last.pid
        assert doc["haproxy"]["master_pid"] == master  # one master throughout
        # Ray's soft-stopped bridges exit 0 once no old worker serves their config.
        await wait_until(lambda: _all_exited(spawn, reload), what="the old bridges to exit")
        assert [spawn.proc.returncode, reload.proc.returncode] == [0, 0]
        await manager.stop()


async def _all_exited(*spawns) -> bool:
    return all(s.proc.returncode is not None for s in spawns)


async def test_ready_only_once_the_daemon_runs_the_config(rundir: Path):
    async with ray_node(rundir) as node:
        manager = node.manager()
        first = await manager.start(node.config("r1"))
        master = (await node.status())["haproxy"]["master_pid"]
        # The HAProxy master stopped: the worker serves on, but no reload can take until SIGCONT.
        os.kill(master, signal.SIGSTOP)
        try:
            second = node.config("r1", tag="r2")
            reload = asyncio.ensure_future(manager.reload(second))
            await wait_until(lambda: _holds(node.daemon.rendered, second), what="the bridge's write")
            await asyncio.sleep(1.5)  # three of Ray's polls
            # Control: the config is in place, yet HAProxy serves the old one. A bridge that said
            # ready here would tell Ray a lie; this one still lets the old bridge answer.
            assert await node.get() == (200, "r1", "r1")
            assert not reload.done()
            assert await manager.running_pid() == first.pid
        finally:
            os.kill(master, signal.SIGCONT)
        new = await reload
        assert await node.get() == (200, "r1", "r2")  # ready means served, at once
        assert await manager.running_pid() == new.pid
        await manager.stop()


async def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except FileNotFoundError:
        return False


async def test_a_refused_config_fails_like_a_failed_haproxy_start(rundir: Path):
    async with ray_node(rundir) as node:
        manager = node.manager()
        good = await manager.start(node.config("r1"))
        reuse = "    http-reuse always\n"
        bad = node.config("r1", tag="bad").replace(reuse, reuse + "    frobnicate on\n")
        with pytest.raises(RuntimeError, match="HAProxy crashed during startup") as failed:
            await manager.reload(bad)
        refused = manager.spawned[-1]
        assert refused.proc.returncode == 1
        # HAProxy's own words, as `haproxy -c` gives them on the same config (the control).
        check = subprocess.run([haproxy_binary(), "-c", "-f", str(manager.config_path)], capture_output=True,
                               text=True, timeout=30)
        assert check.returncode != 0
        words = next(line for line in check.stdout.splitlines() + check.stderr.splitlines() if "frobnicate" in line)
        words = words.split("] : ", 1)[-1].split(": ", 1)[-1]  # past the file name, which differs
        assert words in refused.stderr_text() and words in str(failed.value)
        # HAProxy serves the last good config; the old bridge still stands for it.
        assert await node.get() == (200, "r1", "r1")
        assert await manager.running_pid() == good.pid
        assert good.proc.returncode is None
        await manager.stop()


# ---------------------------------------------------------------- soft-stop, kill


async def test_soft_stopped_bridge_lives_while_an_old_worker_serves_its_config(rundir: Path):
    async with ray_node(rundir) as node:
        manager = node.manager()
        text = node.config("r1")
        first = await manager.start(text)
        held = await KeepAliveClient(node.front).connect()
        assert (await held.get("/a"))[0] == 200  # an idle keep-alive connection on this worker

        # Control: a change of servers only is applied at runtime: no old worker, and the
        # soft-stopped bridge exits although the connection is still held.
        second_text = node.config("r1", "r2")
        second = await manager.reload(second_text)
        await asyncio.wait_for(first.proc.wait(), 10)
        assert first.proc.returncode == 0

        # A reload: the worker serving `second_text` becomes old, and holds the connection
        # (option idle-close-on-response keeps it open until its next answer).
        third = await manager.reload(node.config("r1", "r2", tag="r3"))
        doc = await node.status()
        old = [w for w in doc["old_workers"] if w["rendered_sha256"] == sha(second_text)]
        assert len(old) == 1
        await asyncio.sleep(2.5)  # past the bridge's quiet period, five of Ray's SIGUSR1 rounds
        assert second.proc.returncode is None  # Ray's "node drained" check stays false
        assert manager.has_alive_old_procs()
        assert manager.count_processes() == 2  # serve_haproxy_process_count: current + draining
        assert await manager.running_pid() == third.pid  # the new bridge answers Ray's socket

        # The old worker's last answer closes the connection; it exits, and so does the bridge.
        assert (await held.get("/a"))[0] == 200
        await held.close()
        await asyncio.wait_for(second.proc.wait(), 15)
        assert second.proc.returncode == 0
        doc = await node.status()
        assert not [w for w in doc["old_workers"] if w["pid"] == old[0]["pid"]]
        assert not manager.has_alive_old_procs() and manager.count_processes() == 1
        await manager.stop()


async def test_sigkill_of_the_bridge_or_its_manager_harms_nothing(rundir: Path):
    async with ray_node(rundir) as node:
        manager = node.manager()
        await manager.start(node.config("r1"))
        master = (await node.status())["haproxy"]["master_pid"]
        loop = RequestLoop(node.front, max_requests=3000, max_seconds=30, path="/a").start()
        try:
            # Killed while it waits for the daemon: the config it handed over still goes in.
            manager.write_config(node.config("r1", "r2"))
            waiting = await manager.spawn("-sf", str(manager.current.pid), "-x", str(manager.socket_path))
            await wait_until(lambda: _holds(node.daemon.rendered, manager.config_path.read_text()),
                             what="the bridge's write")
            waiting.proc.kill()
            await waiting.proc.wait()
            # The manager's death: the raylet SIGKILLs its process group, the bridge with it.
            await manager.stop()
            await asyncio.sleep(1)
            # A restarted manager starts afresh (no -sf) over the stale admin.sock.
            restarted = node.manager()
            spawn = await restarted.start(node.config("r1", "r2"))
            assert await restarted.running_pid() == spawn.pid
        finally:
            results = await loop.stop()
        assert len(results) > 20
        assert [r for r in results if r[0] != 200] == []  # no request failed
        doc = await node.status()
        assert doc["haproxy"]["master_pid"] == master
        await restarted.stop()


async def test_control_killing_ray_s_own_haproxy_refuses_requests(rundir: Path):
    """The control for the test above: HAProxy run by Ray itself dies with its manager."""
    with backends("r1", "fb") as started:
        node_dir = rundir / "haproxy-serve"
        front = free_port()
        manager = RayManager(node_dir, haproxy_binary())
        try:
            await manager.start(ray_config(
                node_dir, front, free_port(), free_port(), [App("a", [started["r1"].address])],
                started["fb"].address, prometheus=has_prometheus_exporter(haproxy_binary()),
            ))
            assert (await http_get(front, "/a"))[0] == 200
            await manager.stop()
            assert (await http_get(front, "/a", timeout=2))[0] == 0 and not port_open(front)
        finally:
            await manager.cleanup()


async def test_the_daemon_restarting_under_running_bridges(rundir: Path):
    async with ray_node(rundir) as node:
        manager = node.manager()
        spawn = await manager.start(node.config("r1"))
        master = (await node.status())["haproxy"]["master_pid"]

        # The daemon killed (a crash, an OOM kill): HAProxy serves on, Ray's socket still answers,
        # and the next daemon adopts the master.
        loop = RequestLoop(node.front, max_requests=2000, max_seconds=20, path="/a").start()
        try:
            node.daemon.kill9()
            assert await manager.running_pid() == spawn.pid
            node.daemon.start()
            await node.daemon.wait_log(rf"master adopted pid={master}")
        finally:
            results = await loop.stop()
        assert len(results) > 10 and [r for r in results if r[0] != 200] == []

        # Stopped (systemctl stop / restart stops HAProxy with it): Ray's socket fails as a dead
        # HAProxy's would, so Ray's health check says so, instead of reading an empty answer.
        node.daemon.signal(signal.SIGTERM)
        assert await node.daemon.wait_exit() == 0
        for _ in range(5):  # Ray's polls, each refused
            with pytest.raises(OSError):
                await send_socket_command(manager.socket_path, "show info")
        with pytest.raises(OSError):  # the state it stands for: nothing serves
            await send_socket_command(node.worker_socket, "show info")

        # Started again: HAProxy runs Ray's last config (the watched file), and the same bridge
        # answers for it; Ray's next spawn goes through as before.
        node.daemon.start()
        await wait_until(lambda: _running_pid_is(manager, spawn.pid), what="the bridge to answer again")
        assert await node.get() == (200, "r1", "r1")
        await manager.reload(node.config("r1", "r2"))
        assert {(await node.get())[1] for _ in range(6)} == {"r1", "r2"}
        await manager.stop()


async def _running_pid_is(manager: RayManager, pid: int) -> bool:
    return await manager.running_pid() == pid


# ---------------------------------------------------------------- a manager that starts afresh


async def test_fresh_manager_does_not_replace_a_serving_config_with_an_empty_one(rundir: Path):
    async with ray_node(rundir) as node:
        manager = node.manager()
        serving = node.config("r1")
        await manager.start(serving)
        await manager.stop()  # the actor died; HAProxy is the daemon's and serves on

        restarted = node.manager()
        empty = node.config()  # a started manager's first render: the fallback only
        spawn = await restarted.start(empty)
        held = [line for line in spawn.stderr_text().splitlines() if "held back" in line]
        assert len(held) == 1 and "without -sf" in held[0] and "1 servers" in held[0]
        assert node.daemon.rendered.read_text() == serving
        assert [await node.get() for _ in range(5)] == [(200, "r1", "r1")] * 5
        assert await restarted.running_pid() == spawn.pid

        # Its next render, with the replicas, goes in as usual.
        full = node.config("r1", "r2", tag="r2")
        await restarted.reload(full)
        assert (await node.status())["worker"]["rendered_sha256"] == sha(full)
        # Control: a reload to no servers (-sf: meant, e.g. the app's replicas are gone) is
        # handed over, and the fallback answers - what a fresh manager's render would have done.
        await restarted.reload(empty)
        assert (await node.status())["worker"]["rendered_sha256"] == sha(empty)
        assert (await node.get())[1] == "fb"
        await restarted.stop()


async def test_without_a_daemon_the_bridge_fails_at_once(rundir: Path):
    async with ray_node(rundir) as node:
        node.daemon.cleanup()  # no daemon on this node
        manager = node.manager()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="HAProxy crashed during startup") as failed:
            await manager.start(node.config("r1"))
        assert time.monotonic() - started < 5  # Ray's first poll sees the exit
        spawn = manager.spawned[-1]
        lines = spawn.stderr_text().strip().splitlines()
        assert len(lines) == 1 and "no haproxy-supervisor daemon answers" in lines[0], lines
        assert "no haproxy-supervisor daemon answers" in str(failed.value)
        assert spawn.proc.returncode == 1
        # No HAProxy of its own: nothing listens on Ray's port, nothing runs Ray's config.
        assert not port_open(node.front) and manager.count_processes() == 0
        # Control: the real binary, run the same way, does start an HAProxy of its own.
        stock = node.manager(haproxy_binary())
        await stock.start(node.config("r1"))
        assert port_open(node.front) and stock.count_processes() == 1
        await stock.stop()


def _no_pids(text: str) -> str:
    return re.sub(r"\(\d+\)", "(pid)", text)


async def test_version_and_check_are_answered_by_the_daemons_haproxy(rundir: Path):
    async with ray_node(rundir) as node:
        env = {**os.environ, "HAPROXY_SUPERVISOR_SETTINGS": str(node.daemon.settings_path),
               "RAY_SERVE_HAPROXY_BINARY_PATH": str(node.bridge)}
        cfg = rundir / "check.cfg"
        cfg.write_text(node.config("r1"))
        for args in (["-v"], ["-vv"], ["-c", "-f", str(cfg)]):
            ours = subprocess.run([str(node.bridge), *args], capture_output=True, text=True, env=env, timeout=30)
            real = subprocess.run([haproxy_binary(), *args], capture_output=True, text=True, timeout=30)
            # HAProxy's messages name its PID: `[NOTICE]   (1234) : ...`.
            assert (ours.returncode, ours.stdout, _no_pids(ours.stderr)) == (
                real.returncode, real.stdout, _no_pids(real.stderr),
            )
        assert "HAProxy version" in subprocess.run([str(node.bridge), "-v"], capture_output=True, text=True,
                                                   env=env, timeout=30).stdout
        assert not port_open(node.front)  # a check binds nothing
