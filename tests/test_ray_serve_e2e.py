"""Real Ray Serve 2.60 in HAProxy mode, with the bridge and (the control) as it ships.

Each mode runs tests/support/ray_churn.py once, in namespaces of its own: one app with two
deployments under keep-alive load through a scale up, kill -9 of a replica, a redeploy with new
actor options and one with new code (both replace every replica), kill -9 of the
HAProxyManager, a scale down, then `serve.shutdown`. Marked `ray`: `make test-ray` runs these
once (not once per HAProxy binary); plain pytest leaves them out.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from rigs.harness import short_tmpdir
from rigs.ray_serve import run_scenario
from tests.support.ray_churn import CHURN

pytestmark = [pytest.mark.ray, pytest.mark.haproxy, pytest.mark.timeout(600)]

SCENARIO_TIMEOUT_S = 480
MANAGER_KILL = "kill -9 of the HAProxyManager"
# Steps whose every config from Ray differs from the one before in server lines only.
SERVERS_ONLY = ("scale up", "kill -9 of a replica", "redeploy, new actor options", "scale down")


def run_mode(mode: str) -> Iterator[dict[str, Any]]:
    directory = short_tmpdir("hs-ray-")
    try:
        result = run_scenario("tests.support.ray_churn", ["--mode", mode, "--dir", str(directory)],
                              SCENARIO_TIMEOUT_S, directory / f"{mode}.log")
        print(f"{mode}: {result['seconds']:.0f} s, {len(result['sent'])} requests")
        yield result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def stock() -> Iterator[dict[str, Any]]:
    yield from run_mode("stock")


@pytest.fixture(scope="module")
def bridge() -> Iterator[dict[str, Any]]:
    yield from run_mode("bridge")


# ------------------------------------------------------------------ reading a result


def step(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in result["steps"] if s["name"] == name)


def failed(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in result["sent"] if s["status"] != 200]


def in_flight_at_replica_kill(result: dict[str, Any], sent: dict[str, Any]) -> bool:
    """Sent before the killed replica's process was gone, answered after it was signalled.
    Until its exit has closed its sockets (tens of ms after SIGKILL), its listening socket
    accepts connections, and a request HAProxy sends it then gets no answer: 502 `SH`, not
    retried (Ray's `retry-on conn-failure` replays only what was never sent)."""
    notes = result["notes"]
    return sent["started"] <= notes["killed_replica_gone"] and sent["ended"] >= notes["killed_replica_signalled"]


def killed_replica_server(result: dict[str, Any]) -> str:
    kill = step(result, "kill -9 of a replica")
    (server,) = set(kill["servers_before"]) - set(kill["servers_after"])
    return server


# An httplog line's `<frontend> <backend>/<server> <timers> <status>`.
HTTPLOG = re.compile(r"\] \S+ \S+/(\S+) -?\d+/-?\d+/-?\d+/-?\d+/\+?-?\d+ (\d{3}) ")


def errors_logged(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(server, line) of each request HAProxy's log says it answered with a 5xx."""
    found = []
    for _, line in result["haproxy_log"]:
        if (m := HTTPLOG.search(line)) and m[2].startswith("5"):
            found.append((m[1], line))
    return found


def sent_during(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    s = step(result, name)
    return [r for r in result["sent"] if s["started"] <= r["started"] <= s["ended"]]


def during(result: dict[str, Any], name: str) -> dict[str, Any]:
    """What the daemon's /status said over a step: reloads by result, old workers, worker PIDs."""
    s = step(result, name)
    samples = result["status"]
    before = [x for x in samples if x["at"] <= s["started"]][-1]
    window = [x for x in samples if s["started"] <= x["at"] <= s["ended"]]
    assert len(window) >= 4, f"{name}: {len(window)} /status samples"
    last = window[-1]
    return {
        "reloads": {k: last["reloads"][k] - before["reloads"][k] for k in ("ok", "failed", "unknown")},
        "runtime_applied": last["reloads"]["runtime_applied"] - before["reloads"]["runtime_applied"],
        "old_workers": max(x["old_workers"] for x in window),
        "workers": {x["worker_pid"] for x in window},
    }


def spawned_during(result: dict[str, Any], name: str) -> int:
    s = step(result, name)
    return sum(s["started"] <= at <= s["ended"] for at in result["haproxy"]["first_seen"].values())


def describe(sent: list[dict[str, Any]]) -> str:
    return "; ".join(f"{s['status'] or s['error']} {s['body'][:40]!r} at {s['started']:.2f}" for s in sent[:10])


def around(result: dict[str, Any], sent: list[dict[str, Any]], before_s: float = 3.0, after_s: float = 1.0) -> str:
    """What HAProxy logged (its lines that are no plain 200) and what the daemon did around
    the first failed requests, each line with its time since the load started."""
    zero = result["load_started"]
    notes = result["notes"]
    out = [f"the replica killed at {notes['killed_replica_signalled'] - zero:.3f} s was gone at "
           f"{notes['killed_replica_gone'] - zero:.3f} s; its server: {killed_replica_server(result)}"]
    for s in sent[:3]:
        lo, hi = s["started"] - before_s, s["ended"] + after_s
        out.append(f"\n-- request of client {s['client']} at {s['started'] - zero:.2f}..{s['ended'] - zero:.2f} s:")
        out += [f"  haproxy {at - zero:7.2f} {line[:300]}" for at, line in result["haproxy_log"] if lo <= at <= hi]
        out += [f"  daemon  {e['at'] - zero:7.2f} {e['level']} {e['logger']}: {e['msg'][:300]}"
                for e in result["daemon_log"] if "at" in e and lo <= e["at"] <= hi]
    return "\n".join(out)


NO_RELOAD = {"ok": 0, "failed": 0, "unknown": 0}


# ------------------------------------------------------------------ the bridge


def test_bridge_no_request_fails_but_those_in_flight_on_the_killed_replica(bridge: dict[str, Any]) -> None:
    assert [s["name"] for s in bridge["steps"]] == list(CHURN)
    assert len(bridge["sent"]) > 500
    outside = [s for s in failed(bridge) if not in_flight_at_replica_kill(bridge, s)]
    assert not outside, (f"{len(outside)} of {len(bridge['sent'])} requests failed: {describe(outside)}"
                         f"{around(bridge, outside)}")
    assert len(failed(bridge)) <= bridge["clients"]
    # Each one was HAProxy's, on the killed replica: no other server failed a request.
    killed = killed_replica_server(bridge)
    others = [line for server, line in errors_logged(bridge) if server != killed]
    assert not others, "\n".join(others[:10])


def test_bridge_churn_of_servers_only_makes_no_reload_and_no_old_worker(bridge: dict[str, Any]) -> None:
    for name in SERVERS_ONLY:
        assert step(bridge, name)["renders"] >= 1, name
        assert not step(bridge, name)["beyond_servers"], f"{name}:\n{step(bridge, name)['beyond_servers_diff']}"
        seen = during(bridge, name)
        assert seen["reloads"] == NO_RELOAD, name
        assert seen["runtime_applied"] >= 1, name
        assert seen["old_workers"] == 0, name
        assert len(seen["workers"]) == 1, name


def test_bridge_a_new_codes_transient_render_is_held_and_reloads_nothing(bridge: dict[str, Any]) -> None:
    # Ray 2.60 builds the app again for new code, and renders meanwhile without the ingress
    # deployment's metrics variable (`set-var-fmt(txn.serve_deployment)`) and without its
    # replicas, both back in a later render once the new replicas are up. Its renders differ
    # beyond servers (the control: without the hold, two reloads), but the daemon holds the
    # first for the next one (reload.transient_hold_ms in the Ray settings), which a runtime
    # change applies.
    assert step(bridge, "redeploy, new code")["beyond_servers"]
    seen = during(bridge, "redeploy, new code")
    assert seen["reloads"]["ok"] == 0, seen
    assert seen["runtime_applied"] >= 1, seen
    assert all(s["status"] == 200 for s in sent_during(bridge, "redeploy, new code"))


def test_bridge_the_managers_death_refuses_no_request_and_reloads_nothing(bridge: dict[str, Any]) -> None:
    notes = bridge["notes"]
    assert notes["new_manager_pid"] != notes["killed_manager_pid"]
    window = sent_during(bridge, MANAGER_KILL)
    assert len(window) > 100
    refused = [s for s in window if s["status"] != 200]
    assert not refused, f"{len(refused)} of {len(window)} failed: {describe(refused)}"
    # The new manager's first config has no servers: it rendered beyond servers, and was held back.
    assert step(bridge, MANAGER_KILL)["beyond_servers"]
    assert during(bridge, MANAGER_KILL)["reloads"] == NO_RELOAD


def test_bridge_one_haproxy_master_throughout(bridge: dict[str, Any]) -> None:
    masters = {s["master_pid"] for s in bridge["status"]}
    assert len(masters) == 1 and None not in masters
    # Every HAProxy process seen in the namespace was the daemon's master or one of its workers.
    assert bridge["haproxy"]["masters"] == sorted(masters)


def test_bridge_serve_shutdown_leaves_the_daemon_serving(bridge: dict[str, Any]) -> None:
    assert bridge["shutdown_s"] < 60
    before, after = bridge["before_shutdown"], bridge["after_shutdown"]
    assert after is not None, "the daemon did not answer /status after serve.shutdown"
    assert after["master_pid"] == before["master_pid"]
    assert str(after["master_pid"]) in bridge["haproxy"]["alive_after_shutdown"]


# ------------------------------------------------------------------ the control: Ray as it ships


def test_stock_ray_refuses_requests_when_the_manager_dies(stock: dict[str, Any]) -> None:
    window = sent_during(stock, MANAGER_KILL)
    refused = [s for s in window if s["error"] == "refused"]
    assert len(refused) > len(window) / 2, f"{len(refused)} of {len(window)} refused"


def test_stock_ray_starts_an_haproxy_for_each_change_of_servers(stock: dict[str, Any]) -> None:
    for name in SERVERS_ONLY:
        assert step(stock, name)["renders"] >= 1, name
        assert not step(stock, name)["beyond_servers"], f"{name}:\n{step(stock, name)['beyond_servers_diff']}"
        assert spawned_during(stock, name) >= 1, name
    # Ray's every HAProxy is a process of its own, no master's worker, and old ones stay a while.
    assert len(stock["haproxy"]["masters"]) == len(stock["haproxy"]["first_seen"])
    assert max(count for _, count in stock["haproxy"]["alive_counts"]) >= 2
    assert stock["haproxy"]["alive_after_shutdown"] == {}
