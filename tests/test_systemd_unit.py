"""The unit file: the settings the daemon's design depends on, and systemd's own verifier."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[1] / "systemd" / "haproxy-supervisor.service"


def settings() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key, []).append(value)
    return found


def test_unit_settings_the_daemon_relies_on():
    s = settings()
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["ExecStart"][0].endswith("haproxy-supervisor run --config /etc/haproxy-supervisor/config.yaml")
    # HAProxy must survive a daemon crash for adoption: only the main process is signalled.
    assert s["KillMode"] == ["process"]
    assert s["RuntimeDirectory"] == ["haproxy-supervisor"] and s["RuntimeDirectoryPreserve"] == ["yes"]
    assert s["Restart"] == ["on-failure"] and s["RestartForceExitStatus"] == ["3"]
    assert "WatchdogSec" in s and "LimitNOFILE" in s
    assert s["ProtectSystem"] == ["strict"] and s["ReadWritePaths"] == ["/run/haproxy-supervisor"]
    assert set(s["CapabilityBoundingSet"][0].split()) == {"CAP_NET_BIND_SERVICE", "CAP_NET_ADMIN", "CAP_NET_RAW"}
    # Stop must outlast the default soft-stop window (30 s) plus the hard-stop waits.
    assert int(s["TimeoutStopSec"][0].rstrip("s")) > 30 + 10


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path):
    # verify insists that ExecStart's binary exists; the unit is otherwise checked as shipped.
    unit = tmp_path / "haproxy-supervisor.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/haproxy-supervisor", "/bin/true"))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "haproxy-supervisor.service" not in result.stderr, result.stderr
