"""The status page in a real browser: Debian's Chromium, headless, against the real server.

`make test` installs Chromium (target `chromium`). The browser gets its own profile and
HOME in a temporary directory, talks only to 127.0.0.1, and is stopped by PID. At fleet size
the test drives it through the DevTools protocol (a websocket on 127.0.0.1) to measure the
laid-out page and take a screenshot of all of it; set HS_SCREENSHOT_DIR to keep the
screenshots.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from rigs.harness import free_port, kill_tree
from rigs.status_server import start_status_server
from rigs.status_state import CURRENT_PID, OLD_PIDS, RecordingActions, fleet_dead, fleet_state, running_state
from supervisor.settings import Settings
from supervisor.state import utcnow
from supervisor.status.routes import build_app

BROWSER_TIMEOUT_S = 60


def chromium_binary() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if not found:
        raise RuntimeError("chromium is not installed: run `make test`, which installs Debian's package")
    return found


async def run_chromium(profile: Path, *args: str) -> tuple[int, str]:
    """Run headless Chromium to completion (bounded); kill it and its children by PID if it hangs."""
    proc = await asyncio.create_subprocess_exec(
        chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
        f"--user-data-dir={profile}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "HOME": str(profile)},
    )
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), BROWSER_TIMEOUT_S)
    finally:
        if proc.returncode is None:
            kill_tree(proc.pid)
            await proc.wait()
        _stop_browser(proc.pid, profile)
    assert proc.returncode is not None
    return proc.returncode, stdout.decode(errors="replace")


def _stop_browser(pid: int, profile: Path) -> None:
    kill_tree(pid)
    # Helpers (zygote, renderer) that outlived the browser: find them by our profile, stop by PID.
    for leftover in psutil.process_iter(["pid", "cmdline"]):
        if f"--user-data-dir={profile}" in (leftover.info["cmdline"] or []):
            kill_tree(leftover.info["pid"])


@dataclass
class LaidOut:
    """A page as the browser laid it out."""

    width: int
    height: int
    section_heights: dict[str, int]  # by the section's id
    dom: str
    screenshot: bytes  # PNG of the whole page


async def lay_out(url: str, profile: Path, width: int = 1280) -> LaidOut:
    """Open `url` in headless Chromium driven over the DevTools protocol (port chosen by the
    browser, on 127.0.0.1) and read back the layout, the DOM and a full-page screenshot."""
    proc = await asyncio.create_subprocess_exec(
        chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
        "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--window-size={width},900",
        f"--user-data-dir={profile}", "about:blank",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "HOME": str(profile)},
    )
    try:
        return await asyncio.wait_for(_drive(url, profile), BROWSER_TIMEOUT_S)
    finally:
        _stop_browser(proc.pid, profile)
        await proc.wait()


async def _drive(url: str, profile: Path) -> LaidOut:
    port_file = profile / "DevToolsActivePort"
    while not port_file.exists() or not port_file.read_text().strip():
        await asyncio.sleep(0.05)
    port = int(port_file.read_text().split()[0])
    ids = itertools.count(1)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as answer:
            targets = await answer.json()
        page = next(t for t in targets if t["type"] == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024) as ws:
            events: list[dict[str, Any]] = []

            async def call(method: str, **params: Any) -> dict[str, Any]:
                number = next(ids)
                await ws.send_str(json.dumps({"id": number, "method": method, "params": params}))
                while True:
                    message = json.loads((await ws.receive()).data)
                    if message.get("id") == number:
                        assert "error" not in message, message
                        return message["result"]
                    events.append(message)

            await call("Page.enable")
            await call("Page.navigate", url=url)
            while not any(e.get("method") == "Page.loadEventFired" for e in events):
                events.append(json.loads((await ws.receive()).data))
            metrics = await call("Page.getLayoutMetrics")
            size = metrics["cssContentSize"]
            width, height = int(size["width"]), int(size["height"])
            document = await call("DOM.getDocument", depth=-1)
            dom = (await call("DOM.getOuterHTML", nodeId=document["root"]["nodeId"]))["outerHTML"]
            sections: dict[str, int] = {}
            for section in re.findall(r'<section id="([\w-]+)"', dom):
                node = await call("DOM.querySelector", nodeId=document["root"]["nodeId"], selector=f"#{section}")
                box = await call("DOM.getBoxModel", nodeId=node["nodeId"])
                sections[section] = int(box["model"]["height"])
            shot = await call(
                "Page.captureScreenshot", format="png", captureBeyondViewport=True,
                clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
            )
            with contextlib.suppress(Exception):
                await call("Browser.close")
    return LaidOut(width, height, sections, dom, base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def serving(state) -> AsyncIterator[str]:
    port = free_port()
    runner = await start_status_server(build_app(state, Settings(), RecordingActions(state)), f"127.0.0.1:{port}")
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


UNCONVERGED_REASON = "reload failed: show proc: no answer within reload.timeout_s=10s"


@pytest.fixture
async def page_url() -> AsyncIterator[str]:
    """The running state while a reload is failing: what an on-call engineer is paged for."""
    state = running_state()
    state.convergence.reached()
    state.convergence.missed(UNCONVERGED_REASON, transient=True, now=utcnow() - timedelta(seconds=95))
    state.convergence.attempts = 4
    async with serving(state) as url:
        yield url


def keep_screenshot(name: str, data: bytes) -> None:
    keep = os.environ.get("HS_SCREENSHOT_DIR")
    if keep:
        (Path(keep) / name).write_bytes(data)


async def test_page_renders_in_chromium(page_url: str, tmp_path: Path):
    code, dom = await run_chromium(tmp_path / "profile", "--dump-dom", page_url)
    assert code == 0
    # What the browser built, not what the server sent: rows per old worker, in age order.
    rows = re.findall(r'<tr class="old-worker" data-pid="(\d+)">', dom)
    assert rows == [str(pid) for pid in OLD_PIDS]
    assert re.search(rf'id="current-pid">{CURRENT_PID}<', dom)
    steered = re.search(rf'data-pid="{OLD_PIDS[1]}">.*?<td class="steered">(.*?)</td>', dom, flags=re.S)
    assert steered is not None
    assert re.findall(r'<span class="chip bad">([^<]+)</span>', steered[1]) == [
        "echo/echo_r1", "highscale/highscale_r2",
    ]
    assert "40m " in dom and "3m " in dom  # ages
    header = re.search(r"<header>(.*?)</header>", dom, flags=re.S)
    assert header is not None and re.search(r'id="convergence-badge"[^>]*>not converged 1m \d\ds<', header[1])
    now_panel = re.search(r'<section id="summary">(.*?)</section>', dom, flags=re.S)
    assert now_panel is not None and UNCONVERGED_REASON in now_panel[1]
    assert len(re.findall(r'<tr class="reload">', dom)) == 7
    # The hostile reload error stayed text: the browser found no script element in it.
    assert "<script" not in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom


async def test_page_screenshot(page_url: str, tmp_path: Path):
    shot = tmp_path / "status-page.png"
    code, _ = await run_chromium(tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,900", page_url)
    assert code == 0
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 900)
    # A blank or error page compresses to a few KiB; the real page has text, tables and colour.
    assert len(data) > 30_000
    keep_screenshot(shot.name, data)


# A 1280-pixel-wide window shows the whole fleet drain below this height: the dead servers are
# grouped by count, not listed one by one, and the old workers' steered servers are counted.
FLEET_PAGE_MAX_HEIGHT = 4000
FLEET_DEAD_SECTION_MAX_HEIGHT = 1000


async def test_fleet_page_in_chromium_lists_every_affected_backend_and_stays_bounded(tmp_path: Path):
    """10,000 servers, 1,000 of them dead in 710 backends, 50 old workers."""
    async with serving(fleet_state()) as url:
        page = await lay_out(url, tmp_path / "profile")
    keep_screenshot("status-page-fleet.png", page.screenshot)
    # What the browser built: every affected backend under the line of its count, worst first.
    listed: dict[str, str] = {}
    order = []
    for count, body in re.findall(r'<div class="group \w+" data-count="([^"]+)">(.*?)</div>', page.dom, re.S):
        order.append(count)
        for backend in re.findall(r'data-backend="([^"]+)"', body):
            listed[backend] = count
    assert listed == {backend: f"{dead} of 10 dead" for backend, dead in fleet_dead().items()}
    assert order == ["10 of 10 dead", "3 of 10 dead", "1 of 10 dead"]
    assert len(re.findall(r'<tr class="old-worker"', page.dom)) == 50
    assert page.dom.count("<svg") == 3
    # Bounded: the whole page, and the dead servers' part of it.
    assert page.width == 1280
    assert page.height <= FLEET_PAGE_MAX_HEIGHT, page.section_heights
    assert page.section_heights["dead"] <= FLEET_DEAD_SECTION_MAX_HEIGHT, page.section_heights
    data = page.screenshot
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (page.width, page.height)
    assert len(data) > 100_000
