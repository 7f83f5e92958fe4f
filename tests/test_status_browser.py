"""The status page in a real browser: Debian's Chromium, headless, against the real server.

`make test` installs Chromium (target `chromium`). The browser gets its own profile and
HOME in a temporary directory, talks only to 127.0.0.1, and is stopped by PID.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from supervisor.settings import Settings
from supervisor.status import build_app, start_status_server
from tests.support.harness import free_port, kill_tree
from tests.support.status_state import CURRENT_PID, OLD_PIDS, RecordingActions, running_state

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
        # Helpers (zygote, renderer) that outlived the browser: find them by our profile, stop by PID.
        for leftover in psutil.process_iter(["pid", "cmdline"]):
            if f"--user-data-dir={profile}" in (leftover.info["cmdline"] or []):
                kill_tree(leftover.info["pid"])
    assert proc.returncode is not None
    return proc.returncode, stdout.decode(errors="replace")


@pytest.fixture
async def page_url() -> AsyncIterator[str]:
    state = running_state()
    port = free_port()
    runner = await start_status_server(build_app(state, Settings(), RecordingActions(state)), f"127.0.0.1:{port}")
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


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
    keep = os.environ.get("HS_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / shot.name)
