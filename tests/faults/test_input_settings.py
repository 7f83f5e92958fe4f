"""Bad settings, driven as data: each row must give exit 2 and one line on stderr, never a
traceback, from `run`, `check` and `render` alike (issue 13, items 5 and 8)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rigs.harness import ROOT

# A bad settings file is refused before anything starts; a daemon still running after this
# long accepted it.
COMMAND_TIMEOUT_S = 10


@dataclass(frozen=True)
class Row:
    name: str
    content: bytes | None  # None: the settings path is made by `make` instead
    names: str  # what the one line must mention
    make: str = ""  # "fifo" or "directory"
    env: dict[str, str] = field(default_factory=dict)


def _yaml(text: str) -> bytes:
    return text.encode()


ROWS = [
    Row("non-utf8 bytes", b"reload:\n  debounce_ms: 200\n# caf\xe9\n", "UTF-8"),
    Row("utf-16 file", "reload:\n  debounce_ms: 200\n".encode("utf-16"), "UTF-16"),
    Row("nul in a path", _yaml('haproxy:\n  runtime_dir: "/tmp/a\\0b"\n'), "haproxy.runtime_dir"),
    Row("nul in the binary", _yaml('haproxy:\n  binary: "hap\\0roxy"\n'), "haproxy.binary"),
    Row("10^40 as a duration", _yaml(f"reload:\n  timeout_s: {10**40}\n"), "reload.timeout_s"),
    Row("10^40 as milliseconds", _yaml(f"reload:\n  debounce_ms: {10**40}\n"), "reload.debounce_ms"),
    Row("superscript port", _yaml("status:\n  listen: '127.0.0.1:³'\n"), "status.listen"),
    Row("yaml nested 20,000 deep", _yaml("a: " + "[" * 20_000 + "]" * 20_000 + "\n"), "nested"),
    Row("nan duration", _yaml("reload:\n  timeout_s: .nan\n"), "reload.timeout_s"),
    Row("inf duration", _yaml("haproxy:\n  stop_timeout_s: .inf\n"), "haproxy.stop_timeout_s"),
    Row("fifo as the settings file", None, "not a regular file", make="fifo"),
    Row("directory as the settings file", None, "not a regular file", make="directory"),
    Row("superscript in the observe limit", _yaml(""), "OBSERVE_ERROR_LIMIT",
        env={"HAPROXY_SUPERVISOR_OBSERVE_ERROR_LIMIT": "³"}),
    # PyYAML keeps the last of two equal keys silently (issue 32).
    Row("a key given twice", _yaml("reload:\n  debounce_ms: 200\n  timeout_s: 3\n  debounce_ms: 5\n"),
        "line 4: duplicate key 'debounce_ms'"),
    Row("a section given twice",
        _yaml("reload:\n  debounce_ms: 200\nlogging:\n  level: info\nreload:\n  timeout_s: 3\n"),
        "line 5: duplicate key 'reload'"),
]


def _settings_file(row: Row, directory: Path) -> Path:
    path = directory / "settings.yaml"
    if row.make == "fifo":
        os.mkfifo(path)
    elif row.make == "directory":
        path.mkdir()
    else:
        assert row.content is not None
        path.write_bytes(row.content)
    return path


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG"))}
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=ROOT, env=full_env, text=True,
    )
    try:
        out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"`{' '.join(args[:1])}` still running after {COMMAND_TIMEOUT_S}s: {err[-2000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.parametrize("command", ["run", "check", "render"])
@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_settings_exit_2_with_one_line(row: Row, command: str, tmp_path: Path) -> None:
    path = _settings_file(row, tmp_path)
    result = run_cli([command, "--config", str(path)], row.env)
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("haproxy-supervisor: "), lines
    assert row.names in lines[0], lines


def test_control_good_settings_render_exit_0(tmp_path: Path) -> None:
    """The harness sees success too: a good settings file renders (exit 0, nothing on stderr)."""
    rendered = tmp_path / "haproxy.cfg"
    rendered.write_text("defaults\n    mode http\n")
    path = tmp_path / "settings.yaml"
    path.write_text(f"haproxy:\n  config: {rendered}\n  runtime_dir: {tmp_path / 'run'}\n")
    result = run_cli(["render", "--config", str(path)])
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "mode http" in result.stdout


def _binary(directory: Path, kind: str) -> str:
    if kind == "missing":
        return str(directory / "nonexistent" / "haproxy")
    if kind == "directory":
        (directory / "bin").mkdir()
        return str(directory / "bin")
    script = directory / "haproxy"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    return str(script)


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("kind", ["missing", "not executable", "directory"])
def test_a_binary_that_cannot_run_exits_2_with_one_line(kind: str, command: str, tmp_path: Path) -> None:
    """`run` stayed up, never ready, restarting a master it could not start (issue 32)."""
    rendered = tmp_path / "haproxy.cfg"
    rendered.write_text("defaults\n    mode http\n")
    binary = _binary(tmp_path, kind)
    path = tmp_path / "settings.yaml"
    path.write_text(f"haproxy:\n  binary: {binary}\n  config: {rendered}\n  runtime_dir: {tmp_path / 'run'}\n"
                    f"status:\n  listen: unix:{tmp_path / 'status.sock'}\n")
    result = run_cli([command, "--config", str(path)])
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("haproxy-supervisor: "), lines
    assert "haproxy.binary" in lines[0] and binary in lines[0], lines
