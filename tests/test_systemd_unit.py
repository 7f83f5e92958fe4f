"""The unit file: the settings the daemon's design depends on, and systemd's own verifier."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "haproxy-supervisor.service"
RAY_DROP_IN = ROOT / "systemd" / "ray-node.conf"


def settings(path: Path = UNIT) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
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


def test_ray_drop_in_keeps_the_unit_user_and_opens_only_what_ray_needs():
    """docs/ray-serve.md's layout: the daemon stays `haproxy` (tests/test_ray_bridge_permissions_e2e.py
    runs that layout), reads Ray's files through group ray and sees the host's /tmp."""
    s = settings(RAY_DROP_IN)
    assert s["SupplementaryGroups"] == ["ray"] and s["PrivateTmp"] == ["no"]
    assert s["RuntimeDirectoryMode"] == ["0751"]  # traversable for stats.sock, not group ray's
    assert not {"User", "Group", "CapabilityBoundingSet", "AmbientCapabilities"} & s.keys()
    assert settings()["User"] == ["haproxy"] and settings()["Group"] == ["haproxy"]
    assert s["ReadWritePaths"] == ["/run/haproxy-supervisor-status"]  # status.sock's directory, group ray
    doc = (ROOT / "docs" / "ray-serve.md").read_text()
    assert "install -D -m 0644 systemd/ray-node.conf /etc/systemd/system/haproxy-supervisor.service.d/ray.conf" in doc
    assert "listen: unix:/run/haproxy-supervisor-status/status.sock" in doc
    assert "d /run/haproxy-supervisor-status  2750 haproxy ray -" in doc


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("drop_in", [None, RAY_DROP_IN], ids=["unit", "unit+ray-node.conf"])
def test_systemd_analyze_verify(tmp_path: Path, drop_in: Path | None):
    # verify insists that ExecStart's binary exists; the unit is otherwise checked as shipped.
    unit = tmp_path / "haproxy-supervisor.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/haproxy-supervisor", "/bin/true"))
    if drop_in is not None:  # where systemd looks for it: <unit>.d/ beside the unit
        (tmp_path / "haproxy-supervisor.service.d").mkdir()
        (tmp_path / "haproxy-supervisor.service.d" / "ray.conf").write_text(drop_in.read_text())
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "haproxy-supervisor.service" not in result.stderr, result.stderr
