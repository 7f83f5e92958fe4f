"""The status app over real TCP: every endpoint that reads (/status, /metrics, /healthz,
/readyz, the page) and the JSON answer to unknown paths and methods."""

from __future__ import annotations

import os

from prometheus_client.parser import text_string_to_metric_families

from rigs.status_server import Served, get_json
from rigs.status_server import tcp as tcp  # a fixture
from rigs.status_server import token_file as token_file  # a fixture of tcp
from rigs.status_state import CURRENT_PID, OLD_PIDS
from tests.test_status import documented_schema_keys, key_paths

# ---------------------------------------------------------------- reads


async def test_status_over_tcp(tcp: Served):
    async with tcp.session() as session, session.get("/status") as response:
        assert response.status == 200
        document = await response.json()
    assert key_paths(document) == documented_schema_keys()
    assert document["worker"]["pid"] == CURRENT_PID
    assert [w["pid"] for w in document["old_workers"]] == list(OLD_PIDS)
    assert document["supervisor"]["pid"] == os.getpid()
    assert 3720 < document["supervisor"]["uptime_s"] < 3800


async def test_metrics_over_tcp(tcp: Served):
    async with tcp.session() as session, session.get("/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("haproxy_supervisor_up", ())] == 1
    assert samples[("haproxy_supervisor_reloads_total", (("result", "failed"),))] == 1
    assert samples[("haproxy_supervisor_old_workers", ())] == 2
    assert samples[("haproxy_supervisor_steered_servers", ())] == 3
    assert samples[("haproxy_supervisor_push_duration_seconds_count", ())] == 5
    for name in (
        "haproxy_supervisor_up", "haproxy_supervisor_reloads", "haproxy_supervisor_runtime_applies",
        "haproxy_supervisor_config_generation", "haproxy_supervisor_old_workers",
        "haproxy_supervisor_old_worker_oldest_age_seconds", "haproxy_supervisor_steered_servers",
        "haproxy_supervisor_push_duration_seconds", "haproxy_supervisor_push_failures",
        "haproxy_supervisor_master_restarts",
    ):
        assert families[name].documentation, name
        assert f"# TYPE {name}" in text

    # Metrics follow State from one scrape to the next.
    tcp.state.old_workers.pop(OLD_PIDS[0])
    async with tcp.session() as session, session.get("/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["haproxy_supervisor_old_workers"].samples[0].value == 1


async def test_healthz_follows_the_master(tcp: Served):
    async with tcp.session() as session:
        assert await get_json(session, "GET", "/healthz") == (200, {"status": "ok"})
        tcp.state.master_up = False
        assert await get_json(session, "GET", "/healthz") == (503, {"error": "HAProxy master is not running"})
        tcp.state.master_up = True
        assert (await get_json(session, "GET", "/healthz"))[0] == 200


async def test_readyz_follows_the_current_worker(tcp: Served):
    async with tcp.session() as session:
        assert await get_json(session, "GET", "/readyz") == (200, {"status": "ready"})
        good = tcp.state.last_good_sha256
        tcp.state.last_good_sha256 = "0" * 64  # e.g. the last good config failed to load
        assert await get_json(session, "GET", "/readyz") == (
            503, {"error": "the current worker does not run the last good config"}
        )
        tcp.state.last_good_sha256 = good
        tcp.state.master_up = False
        assert await get_json(session, "GET", "/readyz") == (503, {"error": "HAProxy master is not running"})


async def test_page_over_tcp(tcp: Served):
    async with tcp.session() as session, session.get("/") as response:
        assert response.status == 200
        assert response.content_type == "text/html"
        assert "default-src 'none'" in response.headers["Content-Security-Policy"]
        page = await response.text()
    assert f">{CURRENT_PID}<" in page and all(f">{pid}<" in page for pid in OLD_PIDS)
    assert "echo/echo_r1" in page


async def test_unknown_paths_and_methods_answer_json(tcp: Served):
    async with tcp.session() as session:
        assert await get_json(session, "GET", "/nope") == (404, {"error": "no such endpoint: GET /nope"})
        status, body = await get_json(session, "GET", "/reload")
        assert status == 405 and "POST" in body["error"]
        assert tcp.actions.calls == []
