"""Removals never reload, end to end with the real daemon and HAProxy.

- A drain that moves several replicas of a vanished node (connects hang) to new names in one
  change: no reload, the same worker, every moved replica deleted (2.6.12 answers a `;` line
  of `del server` with no empty line between the answers; read by the empty lines, every
  deletion counted as refused and the change reloaded after `remove_wait_s`).
- A rolling deployment under keep-alive load while a client whose request was in flight on a
  removed server keeps its connection: HAProxy keeps the server connection attached to it
  and refuses `del server` ("Server still has connections attached to it"), even after
  `shutdown sessions server`. No reload: the change is live at once, the server pending in
  /status and /metrics, and deleted in the background once the client has gone. The
  control (`reload.remove_in_background: false`, the path before pending removals) holds
  the change until the request ends, and where the connection stays attached (2.6.12,
  2.8.25) waits `remove_wait_s`, shuts the sessions down, is still refused, and reloads.
- A daemon killed with -9 in the middle of a runtime apply: the next one completes the change
  at runtime, by what the worker holds.
- A reload while a removal is pending: the worker that holds the removed server's connection
  is old now, and the removal stays pending in it (in /status, with its pid) until that
  request ends. Before, the reload ended it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rigs.daemon import Daemon, DaemonSupervised, daemons
from rigs.harness import Backend, KeepAliveClient, VanishedNode, free_port, short_tmpdir
from rigs.rolling import Load, ray_config
from rigs.runtime_rig import LogReceiver
from supervisor.haproxy.answers import parse_servers_state
from supervisor.haproxy.runtime.apply import PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT

pytestmark = pytest.mark.haproxy

APPS = ("app1", "app2", "app3", "app4")


@contextlib.contextmanager
def replica_processes() -> Iterator[dict[str, Backend]]:
    started: dict[str, Backend] = {}
    try:
        yield started
    finally:
        for backend in started.values():
            backend.stop()


def start(started: dict[str, Backend], name: str) -> int:
    started[name] = Backend(name, free_port()).start()
    return started[name].port


async def status_and_metrics(d: Daemon) -> tuple[dict, dict[str, float]]:
    supervised = DaemonSupervised(d)
    _, doc = await supervised.request("/status")
    _, metrics = await supervised.request("/metrics")
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples if not s.labels}
    return json.loads(doc), values


async def server_names(d: Daemon) -> set[str]:
    procs = await d.show_proc()
    assert procs.current_worker is not None
    states = await d.cli.on(procs.current_worker.pid, "show servers state")
    return {f"{line.split()[1]}/{line.split()[3]}" for line in states.splitlines()[2:] if line.strip()}


async def wait_until_gone(d: Daemon, keys: set[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (left := keys & await server_names(d)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not left, f"still in the worker: {left}\n{d.log()}"


async def test_a_drain_moving_several_replicas_of_a_vanished_node_makes_no_reload():
    front = free_port()
    vanished: list[VanishedNode] = []
    settings = {"reload": {"runtime_apply": True}, "old_workers": {"guard": True, "poll_interval_ms": 100}}
    directory = short_tmpdir()
    haproxy_log = LogReceiver(directory / "haproxy-log.sock").follow()
    with replica_processes() as replicas, daemons(directory) as make:
        fallback = start(replicas, "fallback")
        # r1 of every app on the node that vanishes, r2 elsewhere.
        apps = {app: [(f"{app}_r{j}", start(replicas, f"{app}_r{j}")) for j in (1, 2)] for app in APPS}
        d = make(ray_config(front, apps, fallback, log_to=haproxy_log.path), settings).start()
        first = await d.wait_generation(1)
        load = Load(front, list(APPS), clients=len(APPS), max_requests=20_000, max_seconds=60).start()
        try:
            await asyncio.sleep(0.3)
            vanishing = time.monotonic()
            for app in APPS:
                name, port = apps[app][0]
                replicas.pop(name).stop()
                vanished.append(VanishedNode(port))
            assert all(v.connect_hangs() for v in vanished)
            # The controller moves the node's replicas to new names on a live node, in one write.
            moved = {f"{app}/{apps[app][0][0]}" for app in APPS}
            for app in APPS:
                apps[app][0] = (f"{app}_r3", start(replicas, f"{app}_r3"))
            d.write(ray_config(front, apps, fallback, log_to=haproxy_log.path))
            await d.wait_log("reload runtime_applied", whole=True, timeout=30)
            await wait_until_gone(d, moved)
            await asyncio.sleep(0.3)
        finally:
            await load.stop()
            for v in vanished:
                v.close()
        procs = await d.show_proc()
        assert d.count(r"reload ok generation=", whole=True) == 0, d.log()
        assert "runtime apply not possible" not in d.log(), d.log()
        assert procs.current_worker is not None and procs.current_worker.pid == first and not procs.old_workers
        assert {f"{app}/{app}_r3" for app in APPS} <= await server_names(d)
        # On failure: each failed request's status, when it was sent after the vanish began and
        # why it got no answer; HAProxy's log of what did not end in a clean 200; the daemon's steps.
        failed = [(s, round(t - vanishing, 3), load.errors.get(i))
                  for i, (s, t) in enumerate(zip(load.statuses, load.started, strict=True)) if s != 200]
        haproxy_log.close()
        unclean = [line for line in haproxy_log.lines if " 200 " not in line or " ---- " not in line]
        summary = (f"{failed} of {len(load.statuses)}, {load.retried} retried; "
                   f"HAProxy logged {len(haproxy_log.lines)} lines")
        assert len(load.statuses) > 50 and not failed, "\n".join([summary, *unclean, d.log()[-6000:]])
        # A retry is a request in flight on a replica as its process was stopped (it closes the
        # connection; a vanished node would not): at most one per client.
        assert load.retried <= len(APPS), summary


async def wait_changes(d: Daemon, count: int, timeout: float = 60) -> None:
    """Until `count` changes are live, at runtime or by a reload."""
    deadline = time.monotonic() + timeout
    while d.count(r"reload runtime_applied", whole=True) + d.count(r"reload ok generation=", whole=True) < count:
        assert time.monotonic() < deadline, d.log()[-3000:]
        await asyncio.sleep(0.02)


REMOVE_WAIT_S = 4
SLOW_MS = 2500  # the request held on app1_r1; it ends before remove_wait_s
ATTACHED = "Server still has connections attached to it, cannot remove it."


async def rolling_with_a_held_connection(background: bool) -> dict:
    """Three apps of two replicas, every replica replaced by a new name one write at a time
    under keep-alive load. A client's request is in flight on app1_r1 when it is removed; the
    client keeps its keep-alive connection, so HAProxy keeps the server connection attached
    to it and refuses `del server`, `shutdown sessions server` or not (no stream is left to
    shut down)."""
    front = free_port()
    settings = {
        "reload": {"runtime_apply": True, "remove_wait_s": REMOVE_WAIT_S, "remove_in_background": background},
        "old_workers": {"guard": True, "poll_interval_ms": 100},
    }
    names = ("app1", "app2", "app3")
    with replica_processes() as replicas, daemons(short_tmpdir()) as make:
        fallback = start(replicas, "fallback")
        apps = {app: [(f"{app}_r{j}", start(replicas, f"{app}_r{j}")) for j in (1, 2)] for app in names}
        # app1_r1 alone in app1 at first, so the held request lands on it.
        d = make(ray_config(front, {**apps, "app1": apps["app1"][:1]}, fallback), settings).start()
        first = await d.wait_generation(1)
        holder = await KeepAliveClient(front).connect()
        load = Load(front, list(names), clients=3, max_requests=30_000, max_seconds=90).start()
        pending_seen: list[tuple[dict, float | None]] = []
        live_in_flight = False  # app1_r1's removal live while its request still ran
        try:
            slow = asyncio.ensure_future(holder.get(f"/slow?ms={SLOW_MS}", timeout=30))  # app1: the default
            await asyncio.sleep(0.3)
            d.write(ray_config(front, apps, fallback))
            await wait_changes(d, 1)
            step, gone = 1, set()
            for j in (0, 1):
                for app in names:
                    step += 1
                    gone.add(f"{app}/{apps[app][j][0]}")
                    apps[app][j] = (f"{app}_r{j + 3}", start(replicas, f"{app}_r{j + 3}"))
                    d.write(ray_config(front, apps, fallback))
                    await wait_changes(d, step)
                    live_in_flight = live_in_flight or ((app, j) == ("app1", 0) and not slow.done())
                    doc, metrics = await status_and_metrics(d)
                    pending_seen += [(p, metrics.get("haproxy_supervisor_pending_removals"))
                                     for p in doc["pending_removals"]]
            answer = await slow
            # The request ended and the client keeps its connection: 2.6.12 and 2.8.25 keep the
            # server connection attached to it (3.0.11 lets it go, and the server is deleted).
            # `shutdown sessions server` then finds no stream to shut: still refused.
            deadline = time.monotonic() + 30
            while background:
                doc, _ = await status_and_metrics(d)
                held = [p for p in doc["pending_removals"] if p["server"] == "app1/app1_r1"]
                shut = [p for p in held if p["sessions_shut_down"] and p["tries"] > 1]
                pending_seen += [(p, None) for p in shut]
                if not held or shut:
                    break
                assert time.monotonic() < deadline, doc
                await asyncio.sleep(0.2)
        finally:
            await load.stop()
            await holder.close()
        procs = await d.show_proc()
        if background:
            await wait_until_gone(d, gone)  # the client gone, the server is deleted
        doc, metrics = await status_and_metrics(d)
        return {
            "reloads": d.count(r"reload ok generation=", whole=True),
            "same_worker": procs.current_worker is not None and procs.current_worker.pid == first,
            "old_workers": len(procs.old_workers),
            "slow": answer,
            "live_in_flight": live_in_flight,
            "pending_seen": pending_seen,
            "pending_after": (doc["pending_removals"], metrics.get("haproxy_supervisor_pending_removals")),
            "requests": len(load.statuses),
            "non_200": load.non_200,
            "log": d.log(),
        }


async def test_a_rolling_deployment_goes_on_while_a_removed_server_keeps_a_connection_attached():
    r = await rolling_with_a_held_connection(background=True)
    assert r["reloads"] == 0 and r["same_worker"] and r["old_workers"] == 0, r["log"]
    status, body, _ = r["slow"]
    assert (status, body) == (200, "app1_r1")  # the request in flight on the removed server completed
    assert r["live_in_flight"]  # the change did not wait for it
    # app1_r1 was pending, with HAProxy's refusal, in /status and the metric (where HAProxy
    # kept it attached after the request, still refused after `shutdown sessions server`);
    # deleted once the client had gone.
    held = [(p, metric) for p, metric in r["pending_seen"] if p["server"] == "app1/app1_r1"]
    assert held and all(p["last_answer"] == ATTACHED for p, _ in held), r["pending_seen"]
    assert any(metric is not None and metric >= 1 for _, metric in held)
    assert r["pending_after"] == ([], 0)
    assert r["requests"] > 100 and r["non_200"] == 0, (r["non_200"], r["requests"])


async def test_control_without_background_removals_the_attached_connection_makes_a_reload():
    r = await rolling_with_a_held_connection(background=False)
    # The change waited for the request under the master lock; where HAProxy kept the server
    # connection attached to the client afterwards (2.6.12, 2.8.25), it reloaded.
    assert not r["live_in_flight"]
    reloaded = (f"runtime apply not possible, reloading: 1 servers not deleted after {REMOVE_WAIT_S}s and their "
                f"sessions shut down; last `del server app1/app1_r1`: {ATTACHED}")
    assert r["reloads"] == 0 or (reloaded in r["log"] and not r["same_worker"]), r["log"]
    assert not r["pending_seen"]


async def test_a_daemon_killed_in_the_middle_of_a_runtime_apply_completes_it_at_runtime():
    """kill -9 while a removal waits (the blocking path, a request held on the removed server):
    the worker holds the added servers and the removed one in maint. The next daemon reads
    what the worker holds and completes the change at runtime. Before, its `add server` was
    answered `Already exists` and it reloaded."""
    import yaml

    front = free_port()
    settings = {
        "reload": {"runtime_apply": True, "remove_wait_s": 30, "remove_in_background": False},
        "old_workers": {"guard": True, "poll_interval_ms": 100},
    }
    with replica_processes() as replicas, daemons(short_tmpdir()) as make:
        fallback = start(replicas, "fallback")
        r1 = start(replicas, "app1_r1")
        d = make(ray_config(front, {"app1": [("app1_r1", r1)]}, fallback), settings).start()
        first = await d.wait_generation(1)
        holder = await KeepAliveClient(front).connect()
        try:
            slow = asyncio.ensure_future(holder.get("/slow?ms=4000", timeout=30))
            await asyncio.sleep(0.3)
            moved = {"app1": [("app1_r2", start(replicas, "app1_r2")), ("app1_r3", start(replicas, "app1_r3"))]}
            d.write(ray_config(front, moved, fallback))
            await d.wait_log(r"app1/app1_r1 is going DOWN for maintenance", timeout=30)
            await asyncio.sleep(0.3)  # `del server` refused, retried: the apply waits
            assert d.count("reload runtime_applied") == 0
            d.kill9()
            written = yaml.safe_load(d.settings_path.read_text())
            written["reload"]["remove_in_background"] = True
            d.settings_path.write_text(yaml.safe_dump(written))
            d.start()
            await d.wait_log("reload runtime_applied", timeout=30)
            assert d.count(r"holds part of this change already \(2 of 2 added servers") == 1, d.run_log()
            assert (await slow)[:2] == (200, "app1_r1")
        finally:
            await holder.close()
        await wait_until_gone(d, {"app1/app1_r1"})
        procs = await d.show_proc()
        assert procs.current_worker is not None and procs.current_worker.pid == first and not procs.old_workers
        assert d.count(r"reload ok generation=", whole=True) == 0, d.log()
        assert {"app1/app1_r2", "app1/app1_r3"} <= await server_names(d)


async def wait_pending(d: Daemon, key: str, answer: str, timeout: float = 10) -> tuple[dict, float | None]:
    """Until /status lists `key` pending with HAProxy's `answer`; that entry and the metric."""
    deadline = time.monotonic() + timeout
    while True:
        doc, metrics = await status_and_metrics(d)
        found = [p for p in doc["pending_removals"] if p["server"] == key and p["last_answer"] == answer]
        if found:
            return found[0], metrics.get("haproxy_supervisor_pending_removals")
        assert time.monotonic() < deadline, f"{key} not pending: {doc['pending_removals']}\n{d.run_log()[-3000:]}"
        await asyncio.sleep(0.1)


async def test_a_pending_removal_is_picked_up_again_after_a_daemon_restart():
    """A replica replaced while a client's request is in flight on it: its removal is pending
    (in maint at the placeholder). The daemon is killed with -9 and started again: it finds
    the removal by what the worker runs, shows it pending, and deletes it once the client has
    gone, with no reload. Before, the restarted daemon forgot it: nothing pending, and the
    server stayed in the worker."""
    front = free_port()
    settings = {
        "reload": {"runtime_apply": True, "remove_wait_s": 30},
        "old_workers": {"guard": True, "poll_interval_ms": 100},
    }
    with replica_processes() as replicas, daemons(short_tmpdir()) as make:
        fallback = start(replicas, "fallback")
        d = make(ray_config(front, {"app1": [("app1_r1", start(replicas, "app1_r1"))]}, fallback), settings).start()
        first = await d.wait_generation(1)
        holder = await KeepAliveClient(front).connect()
        try:
            slow = asyncio.ensure_future(holder.get("/slow?ms=6000", timeout=30))
            await asyncio.sleep(0.3)
            d.write(ray_config(front, {"app1": [("app1_r2", start(replicas, "app1_r2"))]}, fallback))
            await d.wait_log("reload runtime_applied", timeout=30)
            await wait_pending(d, "app1/app1_r1", ATTACHED)
            d.kill9()
            d.start()
            await d.wait_log("master adopted", timeout=30)
            pending, metric = await wait_pending(d, "app1/app1_r1", ATTACHED)
            assert metric == 1 and not slow.done(), (pending, metric)
            assert (await slow)[:2] == (200, "app1_r1")
        finally:
            await holder.close()
        await wait_until_gone(d, {"app1/app1_r1"})
        doc, metrics = await status_and_metrics(d)
        assert (doc["pending_removals"], metrics.get("haproxy_supervisor_pending_removals")) == ([], 0)
        procs = await d.show_proc()
        assert procs.current_worker is not None and procs.current_worker.pid == first and not procs.old_workers
        assert d.count(r"reload ok generation=", whole=True) == 0, d.log()
        assert "app1/app1_r2" in await server_names(d)


async def test_a_pending_removal_stays_pending_in_the_old_worker_after_a_reload():
    front = free_port()
    settings = {
        "reload": {"runtime_apply": True, "remove_wait_s": 30},
        "old_workers": {"guard": True, "poll_interval_ms": 100},
    }
    with replica_processes() as replicas, daemons(short_tmpdir()) as make:
        fallback = start(replicas, "fallback")
        d = make(ray_config(front, {"app1": [("app1_r1", start(replicas, "app1_r1"))]}, fallback), settings).start()
        first = await d.wait_generation(1)
        holder = await KeepAliveClient(front).connect()
        try:
            slow = asyncio.ensure_future(holder.get("/slow?ms=6000", timeout=30))
            await asyncio.sleep(0.3)
            replaced = {"app1": [("app1_r2", start(replicas, "app1_r2"))]}
            d.write(ray_config(front, replaced, fallback))
            await d.wait_log("reload runtime_applied", timeout=30)
            await wait_pending(d, "app1/app1_r1", ATTACHED)
            d.write(ray_config(front, replaced, fallback, server_s=31))  # a timeout: only a reload applies it
            await d.wait_log(r"reload ok generation=\d+", timeout=30)
            procs = await d.show_proc()
            assert [w.pid for w in procs.old_workers] == [first], procs
            for _ in range(10):  # for a second after the reload, checked by the background task each time
                doc, metrics = await status_and_metrics(d)
                kept = [p["worker_pid"] for p in doc["pending_removals"] if p["server"] == "app1/app1_r1"]
                metric = metrics.get("haproxy_supervisor_pending_removals")
                assert kept == [first] and metric == 1, (doc["pending_removals"], metric, d.log())
                await asyncio.sleep(0.1)
            # Meanwhile the old worker holds it in maint at the placeholder: it routes nothing there.
            held = {s.key: s for s in parse_servers_state(await d.cli.on(first, "show servers state"))}
            removed = held["app1/app1_r1"]
            assert removed.in_maint and (removed.address, removed.port) == (PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT)
            assert not slow.done()
            assert (await slow)[:2] == (200, "app1_r1")
            finished = time.monotonic()
            while (doc := (await status_and_metrics(d))[0])["pending_removals"] and time.monotonic() - finished < 10:
                await asyncio.sleep(0.1)
            assert doc["pending_removals"] == [], d.log()
        finally:
            await holder.close()
        assert d.count(r"app1/app1_r1 pending removal ends: (old worker \d+ holds no connection|worker \d+ exited)",
                       whole=True) == 1, d.log()
