"""Real Ray Serve 2.60 in HAProxy mode, with the bridge and (the control) as it ships.

Each mode runs tests/support/ray_churn.py once, in namespaces of its own: one app with two
deployments under keep-alive load through a scale up, kill -9 of a replica, a redeploy that
replaces every replica, kill -9 of the HAProxyManager, a scale down, then `serve.shutdown`.
Marked `ray`: `make test-ray` runs these once (not once per HAProxy binary); plain pytest
leaves them out.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.harness import short_tmpdir
from tests.support.ray_serve import run_scenario

pytestmark = [pytest.mark.ray, pytest.mark.haproxy, pytest.mark.timeout(600)]

SCENARIO_TIMEOUT_S = 420
CHURN = ("scale up", "kill -9 of a replica", "redeploy", "kill -9 of the HAProxyManager", "scale down")


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


# ------------------------------------------------------------------ reading a result


def step(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in result["steps"] if s["name"] == name)


def failed(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in result["sent"] if s["status"] != 200]


def in_flight_at_replica_kill(result: dict[str, Any], sent: dict[str, Any]) -> bool:
    kill = step(result, "kill -9 of a replica")
    return sent["started"] <= kill["acted"] <= sent["ended"]


def started_during(result: dict[str, Any], name: str, after_s: float = 2.0) -> list[dict[str, Any]]:
    """Requests sent from the step's action until after_s past the moment it had settled."""
    s = step(result, name)
    return [r for r in result["sent"] if s["started"] <= r["started"] <= s["ended"] + after_s]


def churn_samples(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The daemon's /status from the load's start to the end of the last churn step."""
    end = step(result, "scale down")["ended"]
    return [s for s in result["status"] if result["load_started"] <= s["at"] <= end]


def describe(sent: list[dict[str, Any]]) -> str:
    return "; ".join(f"{s['status'] or s['error']} {s['body'][:40]!r} at {s['started']:.2f}" for s in sent[:10])


# ------------------------------------------------------------------ the control: Ray as it ships


def test_stock_ray_refuses_requests_when_the_manager_dies(stock: dict[str, Any]) -> None:
    window = started_during(stock, "kill -9 of the HAProxyManager")
    refused = [s for s in window if s["error"] == "refused"]
    assert len(refused) > len(window) / 2, f"{len(refused)} of {len(window)} refused"


def test_stock_ray_starts_an_haproxy_per_change_and_old_ones_linger(stock: dict[str, Any]) -> None:
    # Ray's every reload is a new HAProxy process with no parent HAProxy: one per change.
    assert len(stock["haproxy"]["masters"]) >= len(CHURN)
    assert stock["haproxy"]["most_alive"] >= 2
    assert stock["haproxy"]["alive_after_shutdown"] == {}
