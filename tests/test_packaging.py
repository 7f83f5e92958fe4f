"""The Dockerfile, checked without a container engine: its health check runs against the real
status server, its settings file loads, and its command is the daemon's.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

from rigs.harness import free_port
from rigs.status_server import start_status_server
from rigs.status_state import RecordingActions, running_state
from supervisor.settings import Settings, load_settings
from supervisor.status.routes import build_app
from supervisor.statusclient import url_from_listen

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instruction(name: str) -> str:
    """The argument text of a Dockerfile instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    found = re.findall(rf"^{name}\s+(.*)$", joined, flags=re.M)
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def healthcheck_argv() -> list[str]:
    text = instruction("HEALTHCHECK")
    options, _, exec_form = text.partition(" CMD ")
    assert "--interval=" in options and "--timeout=" in options
    argv = json.loads(exec_form)  # exec form: a JSON array, no shell
    assert argv[0] == "/opt/haproxy-supervisor/venv/bin/python"
    return argv


async def run_healthcheck(argv: list[str], port: int) -> int:
    code = argv[-1].replace("127.0.0.1:9180", f"127.0.0.1:{port}")
    assert code != argv[-1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv[1:-1], code,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        return await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_image_settings_and_command():
    settings = load_settings(ROOT / "docker" / "config.yaml", environ={})
    assert json.loads(instruction("CMD")) == [
        "haproxy-supervisor", "run", "--config", "/etc/haproxy-supervisor/config.yaml",
    ]
    assert "COPY docker/config.yaml /etc/haproxy-supervisor/config.yaml" in DOCKERFILE
    assert instruction("FROM") == "debian:bookworm-slim"
    assert re.search(r"apt-get install -y --no-install-recommends haproxy ", DOCKERFILE)
    # The health check asks the address the image's settings listen on.
    assert url_from_listen(settings.status.listen) + "/healthz" in healthcheck_argv()[-1]
    assert instruction("EXPOSE") == settings.status.listen.rpartition(":")[2]
    # docker stop must outlast HAProxy's graceful stop (the comment's --stop-timeout 40).
    assert settings.haproxy.stop_timeout_s < 40 and "--stop-timeout 40" in DOCKERFILE


async def test_healthcheck_command_follows_healthz():
    argv = healthcheck_argv()
    state = running_state()
    port = free_port()
    runner = await start_status_server(build_app(state, Settings(), RecordingActions(state)), f"127.0.0.1:{port}")
    try:
        assert await run_healthcheck(argv, port) == 0
        state.master_up = False
        assert await run_healthcheck(argv, port) == 1  # 503: unhealthy
    finally:
        await runner.cleanup()
    assert await run_healthcheck(argv, port) == 1  # nothing listens: unhealthy
