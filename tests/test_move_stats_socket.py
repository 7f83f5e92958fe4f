"""haproxy.move_stats_socket: the rendered config's first global `stats socket` is bound in
runtime_dir instead, its other words kept, so the Ray bridge can bind the rendered path itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from supervisor.effective import build_effective
from supervisor.haproxy.config import Config
from supervisor.haproxy.global_policy import move_stats_socket
from supervisor.settings import HAProxySettings, Settings, SettingsError, load_settings
from tests.conftest import CORPUS

MOVED = Path("/run/hs/stats.sock")

CASES = [
    pytest.param(
        "global\n    stats socket /tmp/ray/admin.sock mode 666 level admin expose-fd listeners\n",
        "global\n    stats socket /run/hs/stats.sock mode 666 level admin expose-fd listeners\n",
        "/tmp/ray/admin.sock",
        id="ray-template-line",
    ),
    pytest.param(
        "global\n\tstats socket /a.sock # the admin socket\r\n    stats socket /b.sock level user\n",
        "global\n\tstats socket /run/hs/stats.sock # the admin socket\r\n    stats socket /b.sock level user\n",
        "/a.sock",
        id="first-only-comment-and-crlf-kept",
    ),
    pytest.param(
        "global\n    stats socket 'unix@/tmp/x y.sock' mode 600\n",
        "global\n    stats socket /run/hs/stats.sock mode 600\n",
        "unix@/tmp/x y.sock",
        id="quoted-address",
    ),
    pytest.param(
        "global\n    stats timeout 30s\n    maxconn 10\n",
        "global\n    stats timeout 30s\n    maxconn 10\n",
        None,
        id="no-stats-socket",
    ),
    pytest.param(
        "global\n    maxconn 10\nfrontend fe\n    stats socket /not/global.sock\n",
        "global\n    maxconn 10\nfrontend fe\n    stats socket /not/global.sock\n",
        None,
        id="outside-global-is-not-it",
    ),
    pytest.param(
        "global\n    stats socket\n    stats socket /c.sock\n",
        "global\n    stats socket\n    stats socket /run/hs/stats.sock\n",
        "/c.sock",
        id="a-line-without-address-is-skipped",
    ),
]


@pytest.mark.parametrize(("rendered", "expected", "address"), CASES)
def test_move_stats_socket(rendered: str, expected: str, address: str | None):
    config = Config.parse(rendered)
    moved, was = move_stats_socket(config, MOVED)
    assert moved.render() == expected
    assert was == address
    assert config.render() == rendered  # the input is left alone


def _settings(move: bool) -> Settings:
    return Settings(
        haproxy=HAProxySettings(runtime_dir=Path("/run/hs"), move_stats_socket=move),
        old_workers=dataclasses.replace(Settings().old_workers, guard=False),
        reload=dataclasses.replace(Settings().reload, preserve_server_state=False),
    )


def test_effective_config_moves_the_socket_only_when_set():
    rendered = (CORPUS / "rayserve.cfg").read_text()
    socket_line = "stats socket /tmp/haproxy-supervisor-corpus-rayserve.sock mode 666 level admin expose-fd listeners"
    assert socket_line in rendered
    assert build_effective(_settings(False), rendered).text == rendered  # control: off changes nothing
    moved = build_effective(_settings(True), rendered).text
    assert socket_line not in moved
    assert "stats socket /run/hs/stats.sock mode 666 level admin expose-fd listeners" in moved
    assert moved.replace("/run/hs/stats.sock", "/tmp/haproxy-supervisor-corpus-rayserve.sock") == rendered


def test_setting_is_read_from_the_file(tmp_path: Path):
    path = tmp_path / "s.yaml"
    path.write_text("haproxy:\n  move_stats_socket: true\n  runtime_dir: /run/hs\n")
    settings = load_settings(path, environ={})
    assert settings.haproxy.move_stats_socket is True
    assert settings.haproxy.stats_socket == MOVED
    assert Settings().haproxy.move_stats_socket is False
    path.write_text("haproxy:\n  move_stats_socket: 1\n")
    with pytest.raises(SettingsError, match="move_stats_socket: must be true or false"):
        load_settings(path, environ={})
