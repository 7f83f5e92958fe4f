"""The `status` CLI against the real status app: the table, JSON, a unix socket from the settings,
and a daemon that is unreachable or answers an error."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from rigs.harness import free_port
from rigs.status_server import Served
from rigs.status_server import tcp as tcp  # a fixture
from rigs.status_server import token_file as token_file  # a fixture of tcp
from rigs.status_server import unix as unix  # a fixture
from rigs.status_state import CURRENT_PID, OLD_PIDS
from tests.test_status import documented_schema_keys, key_paths

# ---------------------------------------------------------------- the `status` command


async def run_status_cli(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    """The CLI as a child process; awaited, so this event loop keeps serving it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor", "status", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, stdout.decode(), stderr.decode()


async def test_status_command_table(tcp: Served):
    code, out, err = await run_status_cli("--url", tcp.base)
    assert (code, err) == (0, "")
    assert f"pid {CURRENT_PID}  generation 3" in out
    assert "old workers (2)" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(tuple(map(str, OLD_PIDS)))]
    assert [row[0] for row in rows] == [str(p) for p in OLD_PIDS]
    assert "echo/echo_r1, highscale/highscale_r2" in out
    assert "dead servers (3): app/app1, echo/echo_r1, highscale/highscale_r2 (operator)" in out


async def test_status_command_json(tcp: Served):
    code, out, _ = await run_status_cli("--url", tcp.base, "--json")
    assert code == 0
    document = json.loads(out)
    assert key_paths(document) == documented_schema_keys()
    assert document["worker"]["pid"] == CURRENT_PID
    assert [w["steered"] for w in document["old_workers"]] == [
        sorted(tcp.state.old_workers[pid].steered) for pid in OLD_PIDS
    ]


async def test_status_command_over_unix_socket_from_settings(unix: Served, tmp_path: Path):
    settings = tmp_path / "settings.yaml"
    settings.write_text(f"status:\n  listen: unix:{unix.socket_path}\n")
    code, out, err = await run_status_cli("--config", str(settings))
    assert (code, err) == (0, "")
    assert f"pid {CURRENT_PID}" in out
    code, out, _ = await run_status_cli("--url", f"unix:{unix.socket_path}", "--json")
    assert code == 0 and json.loads(out)["worker"]["pid"] == CURRENT_PID


async def test_status_command_when_the_daemon_is_unreachable(rundir: Path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = await run_status_cli("--url", url)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"haproxy-supervisor: cannot reach the daemon at {url}: ")
    code, out, err = await run_status_cli("--url", f"unix:{rundir / 'absent.sock'}", "--json")
    assert code == 1 and out == "" and err.count("\n") == 1 and "cannot reach the daemon" in err


async def test_status_command_when_the_daemon_answers_an_error(tcp: Served):
    code, _, err = await run_status_cli("--url", tcp.base + "/nope/status")
    assert code == 1 and err.count("\n") == 1 and "answered HTTP 404" in err
