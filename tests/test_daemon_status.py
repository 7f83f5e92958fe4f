"""Every status endpoint against `haproxy-supervisor run` itself: real daemon, real HAProxy,
real HTTP on 127.0.0.1, the refusals included. The app's own edge cases (unix sockets, the
CLI, the page in Chromium) are in tests/test_status_http_*.py, test_status_command.py and
test_status_browser.py."""

from __future__ import annotations

import asyncio
import json
import subprocess

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rigs.harness import KeepAliveClient, backends, free_port, haproxy_binary
from supervisor.haproxy.answers import parse_show_map

pytestmark = pytest.mark.haproxy

TOKEN = "daemon-test-token"

# Idle keep-alive connections stay open at soft-stop, so the first worker lingers as an old one.
RENDERED = """\
global
    close-spread-time infinite
    hard-stop-after 60s

defaults
    mode http
    timeout connect 200ms
    timeout client 30s
    timeout server 30s
    option idle-close-on-response

frontend fe
    bind 127.0.0.1:{front}
    default_backend app

backend app
    server s1 {backend} check inter 300ms
"""


async def test_every_endpoint_of_a_running_daemon(make, rundir):
    status_port, front = free_port(), free_port()
    token_file = rundir / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with backends("b1") as started:
        d = make(RENDERED.format(front=front, backend=started["b1"].address), {
            "status": {"listen": f"127.0.0.1:{status_port}", "token_file": str(token_file)},
            "old_workers": {"guard": True, "poll_interval_ms": 100},
        })
        d.start()
        worker = await d.wait_generation(1)
        base = f"http://127.0.0.1:{status_port}"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        # A keep-alive client makes the first worker linger as an old worker after a reload.
        held = await KeepAliveClient(front).connect()
        assert (await held.get())[0] == 200
        async with aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=20)) as http:
            async def get(path: str) -> tuple[int, str]:
                async with http.get(path) as r:
                    return r.status, await r.text()

            async def call(method: str, path: str, **kw) -> tuple[int, dict]:
                async with http.request(method, path, **kw) as r:
                    return r.status, await r.json()

            assert (await get("/healthz"))[0] == 200
            assert (await get("/readyz"))[0] == 200

            # Operator actions are refused without, or with a wrong, token.
            assert (await call("POST", "/reload"))[0] == 403
            assert (await call("POST", "/reload", headers={"Authorization": "Bearer nope"}))[0] == 401
            assert (await call("POST", "/servers/app/s1/dead"))[0] == 403
            code, body = await call("POST", "/servers/app/nosuch/dead", headers=auth)
            assert code == 404 and "app/nosuch" in body["error"]
            assert (await call("POST", "/servers/app/bad%3Bname/dead", headers=auth))[0] == 400
            assert (await call("POST", "/reload", headers=auth, data=b"x" * (70 * 1024)))[0] == 413

            # A forced reload through the API makes generation 2; the first worker becomes old.
            code, body = await call("POST", "/reload", headers=auth)
            assert code == 200 and body["reload"]["result"] == "ok", body
            await d.wait_generation(2)

            # An operator marks the server dead: the old worker is steered (fail-fast, no backup).
            code, body = await call("POST", "/servers/app/s1/dead", headers=auth)
            assert code == 200 and body == {"server": "app/s1", "operator_dead": True}

            async def steered() -> dict:
                doc = json.loads((await get("/status"))[1])
                old = {w["pid"]: w for w in doc["old_workers"]}
                # RSS and connections are sampled about once a second, not on every poll.
                ready = worker in old and old[worker]["steered"] == ["app/s1"] and old[worker]["rss_bytes"]
                return doc if ready else {}

            doc: dict = {}
            for _ in range(100):
                doc = await steered()
                if doc:
                    break
                await asyncio.sleep(0.05)
            assert doc, json.loads((await get("/status"))[1])
            assert doc["supervisor"]["ready"] is True
            assert doc["worker"]["generation"] == 2 and doc["worker"]["pid"] != worker
            assert doc["haproxy"]["master_pid"] and doc["haproxy"]["binary"] == haproxy_binary()
            version = subprocess.run([haproxy_binary(), "-v"], capture_output=True, text=True).stdout
            assert f"version {doc['haproxy']['version']} " in version
            assert doc["reloads"]["ok"] >= 1 and doc["reloads"]["last"]["result"] == "ok"
            assert doc["dead_servers"] == ["app/s1"] and doc["operator_dead"] == ["app/s1"]
            old = next(w for w in doc["old_workers"] if w["pid"] == worker)
            assert old["push"]["state"] == "ok" and old["generation"] == 1
            assert old["rss_bytes"] > 0 and old["age_s"] > 0
            # What HAProxy itself holds: the old worker's map has the steering entry.
            entries = dict(parse_show_map(await d.cli.on(worker, f"show map {d.runtime / 'steer.map'}")))
            assert entries.get("app_n") == "0", entries  # no live primary, no backup: fail fast
            # ... and the held connection is answered at once instead of going to app/s1.
            status, _, seconds = await held.get(timeout=5)
            assert status == 503 and seconds < 1.0

            metrics = {
                s.name: s.value
                for family in text_string_to_metric_families((await get("/metrics"))[1])
                for s in family.samples
                if not s.labels or s.labels.get("result") == "ok"
            }
            assert metrics["haproxy_supervisor_up"] == 1
            assert metrics["haproxy_supervisor_config_generation"] == 2
            assert metrics["haproxy_supervisor_old_workers"] >= 1
            assert metrics["haproxy_supervisor_steered_servers"] == 1
            assert metrics["haproxy_supervisor_reloads_total"] >= 1
            assert metrics["haproxy_supervisor_push_duration_seconds_count"] >= 1
            assert metrics["haproxy_supervisor_master_restarts_total"] == 0

            code, page = await get("/")
            assert code == 200 and str(worker) in page and "app/s1" in page
            # Grouped by backend, and charted from what the daemon noted as it ran: the reloads,
            # the pushes, and the old worker it has been polling.
            assert '<div class="group all" data-count="1 of 1 dead">' in page
            assert 'data-backend="app"' in page
            assert "not sampled yet" not in page and "no reloads yet" not in page and "no pushes yet" not in page
            assert "now 1</text>" in page  # the old workers chart ends at the one old worker

            # Cleared: the old worker's map is emptied again.
            code, body = await call("DELETE", "/servers/app/s1/dead", headers=auth)
            assert code == 200 and body["operator_dead"] is False
            for _ in range(100):
                entries = dict(parse_show_map(await d.cli.on(worker, f"show map {d.runtime / 'steer.map'}")))
                if not entries:
                    break
                await asyncio.sleep(0.05)
            assert not entries
        await held.close()
