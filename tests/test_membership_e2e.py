"""Servers added and removed at runtime, end to end with the real daemon and HAProxy.

- A replica added at runtime is in the worker's model, slot table and /status; after a reload
  for another reason its worker is old, and when the replica's node vanishes the old worker
  is steered away from it like from any server of its config.
- A rolling deployment of Ray-shaped backends (every replica replaced by a new name on a new
  port) under keep-alive load: no reload, no old worker, no non-200. The control
  (`reload.runtime_apply: false`) shows the reloads and old workers it avoids.
- What `add server` refuses (`init-addr`) reloads, with one log line saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from pathlib import Path

import pytest

from rigs.daemon import Daemon, daemons
from rigs.harness import Backend, KeepAliveClient, VanishedNode, free_port, short_tmpdir
from rigs.rolling import CONNECT_TIMEOUT_S, Load, ray_config
from supervisor.haproxy.answers import parse_show_map
from supervisor.haproxy.runtime.plan import loaded_slot_table

pytestmark = pytest.mark.haproxy

@contextlib.contextmanager
def replica_processes() -> object:
    started: dict[str, Backend] = {}
    try:
        yield started
    finally:
        for backend in started.values():
            backend.stop()


def start(started: dict[str, Backend], name: str) -> int:
    started[name] = Backend(name, free_port()).start()
    return started[name].port


async def status_of(d: Daemon) -> dict:
    from rigs.daemon import DaemonSupervised

    _, text = await DaemonSupervised(d).request("/status")
    return json.loads(text)


async def worker_pid(d: Daemon) -> int:
    procs = await d.show_proc()
    assert procs.current_worker is not None
    return procs.current_worker.pid


async def slot_table_of(d: Daemon, pid: int) -> dict[str, str]:
    path = loaded_slot_table(await d.cli.on(pid, "show map"))
    assert path is not None
    return dict(parse_show_map(await d.cli.on(pid, f"show map {path}")))


async def bodies(front: int, path: str, count: int) -> list[str]:
    client = await KeepAliveClient(front).connect()
    try:
        return [(await client.get(path, timeout=5))[1] for _ in range(count)]
    finally:
        await client.close()


SETTINGS = {
    "reload": {"runtime_apply": True},
    "old_workers": {"guard": True, "poll_interval_ms": 100},
}


async def test_a_replica_added_at_runtime_is_steered_in_the_old_worker_when_its_node_vanishes(tmp_path: Path):
    front = free_port()
    vanished: VanishedNode | None = None
    with replica_processes() as replicas, daemons(short_tmpdir()) as make:
        r1, fallback = start(replicas, "app_r1"), start(replicas, "fallback")
        v1 = ray_config(front, {"app": [("app_r1", r1)]}, fallback)
        d = make(v1, SETTINGS).start()
        pid = await d.wait_generation(1)

        r2 = start(replicas, "app_r2")
        v2 = ray_config(front, {"app": [("app_r1", r1), ("app_r2", r2)]}, fallback)
        d.write(v2)
        await d.wait_log("reload runtime_applied", whole=True)
        assert await worker_pid(d) == pid  # no reload
        assert re.search(r"runtime apply to worker \d+: 1 servers added, 0 removed", d.log())
        seen = set(await bodies(front, "/app", 20))
        assert "app_r2" in seen, seen
        # The worker's slot table follows (the guard reads it once the worker is old).
        assert await slot_table_of(d, pid) == {"app_0": "app_r1", "app_1": "app_r2"}
        # The generation's recorded config is what the worker now runs.
        assert "server app_r2" in (d.runtime / "generations" / "1.cfg").read_text()

        # Keep-alive connections held by this worker, then a reload for another reason.
        held = [await KeepAliveClient(front).connect() for _ in range(8)]
        for client in held:
            assert (await client.get("/app"))[0] == 200
        d.write(ray_config(front, {"app": [("app_r1", r1), ("app_r2", r2)]}, fallback, server_s=29))
        await d.wait_generation(2)
        procs = await d.show_proc()
        assert pid in [w.pid for w in procs.old_workers]

        # app_r2's node vanishes: connects to it now hang.
        replicas.pop("app_r2").stop()
        vanished = VanishedNode(r2)
        try:
            assert vanished.connect_hangs()
            deadline = time.monotonic() + 15
            while True:
                doc = await status_of(d)
                old = next((w for w in doc["old_workers"] if w["pid"] == pid), None)
                if old is not None and "app/app_r2" in old["steered"] and old["push"]["state"] == "ok":
                    break
                assert time.monotonic() < deadline, f"old worker {pid} not steered away from app_r2: {doc}"
                await asyncio.sleep(0.1)
            # Every request on the old worker's connections is answered by app_r1, at once (the
            # old worker answers one more request on each, `connection: close`). Unsteered, each
            # has one chance in two of going to app_r2 and waiting out the connect timeouts.
            for client in held:
                status, body, seconds = await client.get("/app", timeout=10)
                assert (status, body) == (200, "app_r1")
                assert seconds < CONNECT_TIMEOUT_S, seconds
        finally:
            for client in held:
                await client.close()
            vanished.close()


# ---------------------------------------------------------------- the rolling deployment

APPS = ("app1", "app2", "app3")
REPLICAS = 3


async def rolling_deployment(directory: Path, runtime_apply: bool) -> dict:
    """Every replica of three Ray-shaped backends replaced one by one by a new name on a new
    port, under keep-alive load; what it cost."""
    front = free_port()
    settings = {
        "reload": {"runtime_apply": runtime_apply, "remove_wait_s": 5},
        "old_workers": {"guard": True, "poll_interval_ms": 100},
    }
    old_pids: set[int] = set()
    with replica_processes() as replicas, daemons(directory) as make:
        fallback = start(replicas, "fallback")
        apps = {app: [(f"{app}_r{j}", start(replicas, f"{app}_r{j}")) for j in range(1, REPLICAS + 1)] for app in APPS}
        d = make(ray_config(front, apps, fallback), settings).start()
        first = await d.wait_generation(1)
        load = Load(front, list(APPS), clients=len(APPS), max_requests=30_000, max_seconds=120).start()
        try:
            await asyncio.sleep(0.3)
            step = 0
            for j in range(REPLICAS):
                for app in APPS:
                    step += 1
                    gone, _ = apps[app][j]
                    name = f"{app}_r{j + 1 + REPLICAS}"
                    apps[app][j] = (name, start(replicas, name))
                    d.write(ray_config(front, apps, fallback))
                    if runtime_apply:
                        await d.wait_log("reload runtime_applied", count=step, whole=True, timeout=30)
                    else:
                        await d.wait_generation(step + 1, timeout=30)
                    old_pids.update(w.pid for w in (await d.show_proc()).old_workers)
                    replicas.pop(gone).stop()  # the replaced replica goes away
                    await asyncio.sleep(0.2)
            await asyncio.sleep(0.3)
        finally:
            await load.stop()
        procs = await d.show_proc()
        old_pids.update(w.pid for w in procs.old_workers)
        assert procs.current_worker is not None
        states = await d.cli.on(procs.current_worker.pid, "show servers state")
        return {
            "reloads": d.count(r"reload ok generation=", whole=True),
            "runtime_applied": d.count(r"reload runtime_applied", whole=True),
            "old_workers": len(old_pids),
            "same_worker": procs.current_worker.pid == first,
            "requests": len(load.statuses),
            "non_200": load.non_200,
            "bodies": load.bodies,
            "servers": {line.split()[3] for line in states.splitlines()[2:] if line.strip()},
            "log": d.log(),
        }


async def test_a_rolling_deployment_moves_every_replica_without_a_reload():
    result = await rolling_deployment(short_tmpdir(), runtime_apply=True)
    assert result["reloads"] == 0 and result["old_workers"] == 0 and result["same_worker"], result["log"]
    assert result["runtime_applied"] == len(APPS) * REPLICAS
    assert result["requests"] > 100 and result["non_200"] == 0, (result["non_200"], result["requests"])
    new_names = {f"{app}_r{j}" for app in APPS for j in range(REPLICAS + 1, 2 * REPLICAS + 1)}
    assert new_names <= result["bodies"], result["bodies"]  # every new replica served traffic
    assert result["servers"] == new_names | {"fallback"}  # the replaced ones are deleted


async def test_control_without_runtime_apply_every_replica_move_is_a_reload_and_an_old_worker():
    result = await rolling_deployment(short_tmpdir(), runtime_apply=False)
    assert result["reloads"] == len(APPS) * REPLICAS and result["runtime_applied"] == 0
    assert result["old_workers"] > 0 and not result["same_worker"]


async def test_what_add_server_refuses_reloads_and_says_why():
    front = free_port()
    with replica_processes() as replicas, daemons(short_tmpdir()) as make:
        r1, fallback = start(replicas, "app_r1"), start(replicas, "fallback")
        v1 = ray_config(front, {"app": [("app_r1", r1)]}, fallback)
        d = make(v1, SETTINGS).start()
        await d.wait_generation(1)
        r2 = start(replicas, "app_r2")
        v2 = ray_config(front, {"app": [("app_r1", r1), ("app_r2", r2)]}, fallback)
        # `init-addr` is refused for a dynamic server (2.6 to 3.4); `cookie` is accepted from 3.x.
        d.write(v2.replace(f"127.0.0.1:{r2} check", f"127.0.0.1:{r2} check init-addr last,libc,none"))
        await d.wait_generation(2)
        (line,) = [x for x in d.log().splitlines() if "runtime apply not possible" in x]
        assert "`add server app/app_r2 " in line and "'init-addr' option is not accepted" in line, line
        assert d.count("reload runtime_applied", whole=True) == 0


# ---------------------------------------------------------------- a removed server's sessions


async def replace_under_a_slow_request(
    remove_wait_s: float, slow_ms: int
) -> tuple[Daemon, tuple[int, str, float], float]:
    """app_r1 (the only primary) replaced by app_r2 while a slow request runs on app_r1:
    (the daemon, the slow request's (status, body, seconds), seconds from the write to the
    change applied)."""
    front = free_port()
    with replica_processes() as replicas, daemons(short_tmpdir()) as make:
        r1, fallback = start(replicas, "app_r1"), start(replicas, "fallback")
        settings = {**SETTINGS, "reload": {"runtime_apply": True, "remove_wait_s": remove_wait_s}}
        d = make(ray_config(front, {"app": [("app_r1", r1)]}, fallback), settings).start()
        await d.wait_generation(1)
        r2 = start(replicas, "app_r2")
        client = await KeepAliveClient(front).connect()
        try:
            slow = asyncio.ensure_future(client.get(f"/slow?ms={slow_ms}", timeout=30))
            await asyncio.sleep(0.3)
            written = time.monotonic()
            d.write(ray_config(front, {"app": [("app_r2", r2)]}, fallback))
            await d.wait_log("reload runtime_applied", whole=True, timeout=30)
            applied_after = time.monotonic() - written
            answer = await slow
        finally:
            await client.close()
        assert await bodies(front, "/app", 3) == ["app_r2"] * 3
        deadline = time.monotonic() + 20  # deleted in the background once its session ends
        while "app_r1" in (states := await d.cli.on(await worker_pid(d), "show servers state app")):
            assert time.monotonic() < deadline, d.log()
            await asyncio.sleep(0.1)
        assert "app_r2" in states
        assert d.count(r"reload ok generation=", whole=True) == 0
        return d, answer, applied_after


async def test_a_removed_server_is_deleted_once_its_sessions_end():
    d, (status, body, seconds), applied_after = await replace_under_a_slow_request(remove_wait_s=10, slow_ms=2000)
    assert (status, body) == (200, "app_r1")  # the request in flight on the removed server completes
    assert applied_after < seconds, (applied_after, seconds)  # the change did not wait for it: a pending removal
    assert re.search(r"app/app_r1 deleted after \d+ tries", d.log())
    assert "shutting them down" not in d.log()


async def test_sessions_still_on_a_removed_server_after_the_bound_are_shut_down():
    d, (status, _, seconds), applied_after = await replace_under_a_slow_request(remove_wait_s=0.5, slow_ms=8000)
    assert status != 200 and seconds < 5  # cut by `shutdown sessions server`, not served
    assert applied_after < 5, applied_after
    assert re.search(r"sessions still on 1 removed servers after 0.5s: shutting them down", d.log())
