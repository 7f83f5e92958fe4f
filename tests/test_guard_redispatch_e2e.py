"""The guard's `option redispatch 1` through the real binaries: `haproxy -c` accepts the effective
config, without a warning, on every installed binary (2.6.12, Ray's 2.8.25, the 3.0.11 build), for
backends that say nothing of redispatch, say it in themselves or in their defaults (`from` chains
included), and `listen` sections."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.retry_hole import installed_binaries
from supervisor.effective import build_effective, prepare_runtime_dir, write_slot_table
from supervisor.haproxy.config import Config
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings

RENDERED = """\
defaults plain
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s

defaults said from plain
    option redispatch 2

frontend fe from plain
    bind 127.0.0.1:{port}
    use_backend %[path,field(2,/)]

backend nothing_said from plain
    server s1 127.0.0.1:1
    server s2 127.0.0.1:2

backend said_here from plain
    no option redispatch
    server s1 127.0.0.1:1

backend said_with_n from plain
    option redispatch 3
    server s1 127.0.0.1:1

backend said_in_defaults from said
    server s1 127.0.0.1:1

listen tcp_listen from plain
    mode tcp
    bind 127.0.0.1:{tcp}
    server s1 127.0.0.1:1
"""
EXPECTED = {
    "nothing_said": ["option redispatch 1"],
    "said_here": ["no option redispatch"],
    "said_with_n": ["option redispatch 3"],
    "said_in_defaults": [],
    "tcp_listen": ["option redispatch 1"],
}


def redispatch_lines(text: str) -> dict[str, list[str]]:
    config = Config.parse(text)
    return {s.name: [" ".join(line.words) for line in s.body if "redispatch" in line.words]
            for s in config.backends()}


@pytest.mark.parametrize("binary", installed_binaries(), ids=lambda b: Path(b).parent.name)
def test_the_effective_config_with_option_redispatch_passes_haproxy_check(binary, tmp_path):
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path / "run"),
                        old_workers=OldWorkerSettings(guard=True))
    prepare_runtime_dir(settings)
    effective = build_effective(settings, RENDERED.format(port=18091, tcp=18092))
    assert redispatch_lines(effective.text) == EXPECTED, effective.text
    write_slot_table(effective.slot_table)
    out = tmp_path / "effective.cfg"
    out.write_text(effective.text)
    result = subprocess.run([binary, "-c", "-f", str(out)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr, result.stdout + result.stderr
