"""The Ray bridge's channel to the daemon is guarded by file permissions alone (no token, no TCP):
the layout docs/ray-serve.md gives, with the bridge run as an unprivileged user, as Ray's user runs it."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ray_node import ray_node

pytestmark = pytest.mark.haproxy

NOBODY = 65534
RAY_GROUP = 1  # stands for Ray's group: a group root's daemon shares with Ray's user


def _python_for(uid: int, gid: int) -> str | None:
    """A python that `uid` may run and that imports the bridge from this checkout, or None."""
    paths = [str(Path(__file__).resolve().parents[1]), *site.getsitepackages()]
    for candidate in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        probe = subprocess.run(
            [candidate, "-c", f"import os, sys; os.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid}); "
             f"sys.path[:0] = {paths!r}; import supervisor.ray_bridge.main"],
            capture_output=True, timeout=60,
        ) if Path(candidate).exists() else None
        if probe is not None and probe.returncode == 0:
            return candidate
    return None


def _bridge_as(path: Path, python: str, uid: int, gid: int) -> Path:
    """The bridge, run as `uid` in group `gid` only (as Ray's user runs it); the PID stays Ray's spawn's."""
    paths = [str(Path(__file__).resolve().parents[1]), *site.getsitepackages()]
    path.write_text(
        f"#!{python}\nimport os, sys\nos.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})\n"
        f"sys.path[:0] = {paths!r}\nfrom supervisor.ray_bridge.main import main\nsys.exit(main())\n"
    )
    path.chmod(0o755)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the bridge as another user")
async def test_who_may_hand_a_config_over_is_decided_by_file_permissions(rundir: Path):
    """The layout docs/ray-serve.md gives: runtime_dir root:ray 2750 (status.sock 0660 takes
    group ray), the handover directory ray-owned, settings readable. A bridge in Ray's group hands
    its config over; the control, the same bridge outside the group, reaches nothing."""
    python = _python_for(NOBODY, RAY_GROUP)
    if python is None:
        pytest.skip("no python here that an unprivileged user may run with this checkout's packages")
    rundir.chmod(0o755)
    runtime = rundir / "d" / "run"
    runtime.mkdir(parents=True)
    os.chown(runtime, 0, RAY_GROUP)
    runtime.chmod(0o2750)
    handover = rundir / "handover"
    handover.mkdir()
    os.chown(handover, NOBODY, RAY_GROUP)
    handover.chmod(0o750)
    settings = {
        "haproxy": {"config": str(handover / "haproxy.cfg")},
        "status": {"listen": f"unix:{runtime / 'status.sock'}"},
    }
    async with ray_node(rundir, settings) as node:
        (rundir / "d").chmod(0o755)
        node.daemon.settings_path.chmod(0o644)
        ray_dir = rundir / "haproxy-serve"
        ray_dir.mkdir()
        os.chown(ray_dir, NOBODY, NOBODY)
        assert (runtime / "status.sock").stat().st_gid == RAY_GROUP  # the setgid bit's doing

        outsider = node.manager(_bridge_as(rundir / "outsider", python, NOBODY, NOBODY))
        with pytest.raises(RuntimeError, match="Permission denied"):
            await outsider.start(node.config("r1"))
        assert not (handover / "haproxy.cfg").exists()  # nothing handed over
        await outsider.stop()

        member = node.manager(_bridge_as(rundir / "member", python, NOBODY, RAY_GROUP))
        text = node.config("r1")
        spawn = await member.start(text)
        assert (handover / "haproxy.cfg").read_text() == text
        assert (handover / "haproxy.cfg").stat().st_uid == NOBODY
        assert await node.get() == (200, "r1", "r1")
        assert await member.running_pid() == spawn.pid
        await member.stop()
