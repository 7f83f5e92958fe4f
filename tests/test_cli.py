"""`render` and `check`: output, exit codes, one-line errors, the rendered file left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CORPUS

ENV_GATES = (
    "RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED",
    "HAPROXY_SUPERVISOR_OBSERVE_MARK_DOWN_ENABLED",
    "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT",
    "HAPROXY_SUPERVISOR_OBSERVE_ERROR_LIMIT",
)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ENV_GATES}
    base["PATH"] = base.get("PATH", "") + ":/usr/sbin"
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        capture_output=True, text=True, timeout=60, env={**base, **(env or {})},
    )


@pytest.fixture
def setup(tmp_path: Path) -> Path:
    rendered = tmp_path / "rendered.cfg"
    rendered.write_text((CORPUS / "rayserve.cfg").read_text())
    settings = tmp_path / "settings.yaml"
    settings.write_text(
        "haproxy:\n  config: rendered.cfg\n  runtime_dir: run\nold_workers:\n  guard: false\n"
    )
    return settings


def test_render_gate_off_is_byte_identical(setup):
    result = run_cli("render", "--config", str(setup))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (CORPUS / "rayserve.cfg").read_text()


def test_render_gate_on_from_env(setup):
    result = run_cli("render", "--config", str(setup), env={
        "RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED": "true", "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT": "5",
    })
    assert result.returncode == 0, result.stderr
    assert "observe layer4 error-limit 5 on-error mark-down" in result.stdout


def test_check_valid_and_rendered_file_untouched(setup):
    rendered = setup.parent / "rendered.cfg"
    before = rendered.read_bytes(), rendered.stat().st_mtime_ns
    result = run_cli("check", "--config", str(setup), env={"HAPROXY_SUPERVISOR_OBSERVE_MARK_DOWN_ENABLED": "1"})
    assert result.returncode == 0, result.stderr
    assert (rendered.read_bytes(), rendered.stat().st_mtime_ns) == before


def test_check_invalid_exits_1_with_haproxy_message(setup):
    rendered = setup.parent / "rendered.cfg"
    rendered.write_text(rendered.read_text() + "backend broken\n    server s 127.0.0.1:1 bogus-keyword\n")
    result = run_cli("check", "--config", str(setup))
    assert result.returncode == 1
    assert "bogus-keyword" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("settings_text", "env", "needle"),
    [
        ("reload:\n  debounce_ms: -1\n", {}, "reload.debounce_ms: must be positive"),
        ("nope: 1\n", {}, "nope: unknown key"),
        ("", {"RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED": "sometimes"},
         "RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED='sometimes'"),
        ("", {"RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT": "0"}, "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT='0'"),
    ],
)
@pytest.mark.parametrize("command", ["render", "check"])
def test_bad_settings_exit_2_with_one_line(tmp_path, command, settings_text, env, needle):
    settings = tmp_path / "s.yaml"
    settings.write_text(settings_text)
    result = run_cli(command, "--config", str(settings), env=env)
    assert result.returncode == 2
    assert needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_missing_settings_file_exit_2(tmp_path):
    result = run_cli("render", "--config", str(tmp_path / "absent.yaml"))
    assert result.returncode == 2
    assert "absent.yaml" in result.stderr and "Traceback" not in result.stderr


def test_missing_rendered_config_exit_1(tmp_path):
    settings = tmp_path / "s.yaml"
    settings.write_text("haproxy:\n  config: nothere.cfg\n")
    result = run_cli("render", "--config", str(settings))
    assert result.returncode == 1
    assert "nothere.cfg" in result.stderr and "Traceback" not in result.stderr


def test_check_with_unwritable_runtime_dir_exit_1(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    settings = tmp_path / "s.yaml"
    (tmp_path / "r.cfg").write_text("backend b\n  server s 127.0.0.1:1\n")
    settings.write_text("haproxy:\n  config: r.cfg\n  runtime_dir: file/run\n")
    result = run_cli("check", "--config", str(settings))
    assert result.returncode == 1
    assert "cannot prepare runtime_dir" in result.stderr and "Traceback" not in result.stderr
