"""The Ray bridge's channel to the daemon is guarded by file permissions alone (no token, no TCP):
the layout docs/ray-serve.md gives, with the bridge run as an unprivileged user, as Ray's user runs it;
and the master CLI out of that user's reach."""

from __future__ import annotations

import dataclasses
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rigs.daemon import RunAs
from rigs.harness import haproxy_binary
from tests.support.ray_node import ray_node

pytestmark = pytest.mark.haproxy

NOBODY = 65534
RAY_GROUP = 1  # stands for Ray's group
# Stands for the unit's `haproxy` user, in Ray's group as systemd/ray-node.conf's SupplementaryGroups=ray puts it.
DAEMON = RunAs(65533, 65533, (RAY_GROUP,))


def _checkout_paths() -> list[str]:
    """This checkout and the test run's packages, for a python run as another user."""
    return [str(Path(__file__).resolve().parents[1]), *site.getsitepackages()]


def _python_for(uid: int, gid: int) -> str | None:
    """A python that `uid` may run and that imports the bridge from this checkout, or None."""
    paths = _checkout_paths()
    for candidate in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        probe = subprocess.run(
            [candidate, "-c", f"import os, sys; os.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid}); "
             f"sys.path[:0] = {paths!r}; import supervisor.ray_bridge"],
            capture_output=True, timeout=60,
        ) if Path(candidate).exists() else None
        if probe is not None and probe.returncode == 0:
            return candidate
    return None


def _bridge_as(path: Path, python: str, uid: int, gid: int) -> Path:
    """The bridge, run as `uid` in group `gid` only (as Ray's user runs it); the PID stays Ray's spawn's."""
    paths = _checkout_paths()
    path.write_text(
        f"#!{python}\nimport os, sys\nos.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})\n"
        f"sys.path[:0] = {paths!r}\nfrom supervisor.ray_bridge import main\nsys.exit(main())\n"
    )
    path.chmod(0o755)
    return path


def _connect_as(path: Path, python: str, uid: int, gid: int) -> str:
    """What connecting to the unix socket `path` as `uid` in group `gid` only gives: "connected" or the error."""
    probe = subprocess.run(
        [python, "-c", f"import os, socket; os.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})\n"
         f"s = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({str(path)!r}); print('connected')\n"
         "except OSError as e:\n    print(e.strerror)"],
        capture_output=True, text=True, timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.strip()


def _make_dir(path: Path, uid: int, gid: int, mode: int) -> Path:
    path.mkdir(parents=True)
    os.chown(path, uid, gid)
    path.chmod(mode)
    return path


def _binary_for(run_as: RunAs, directory: Path) -> str:
    """The HAProxy binary under test, or a copy of it in `directory` when `run_as` may not run it
    where it is (a build under root's home)."""
    binary = haproxy_binary()
    try:
        subprocess.run([binary, "-v"], capture_output=True, timeout=60, check=True,
                       user=run_as.uid, group=run_as.gid, extra_groups=list(run_as.groups))
        return binary
    except (OSError, subprocess.CalledProcessError):
        copy = directory / "haproxy"
        shutil.copy2(binary, copy)
        return str(copy)


def _ray_node_runtime_mode() -> int:
    """The mode systemd/ray-node.conf has systemd give runtime_dir on a Ray node."""
    for line in (Path(__file__).resolve().parents[1] / "systemd" / "ray-node.conf").read_text().splitlines():
        if line.startswith("RuntimeDirectoryMode="):
            return int(line.partition("=")[2], 8)
    raise AssertionError("systemd/ray-node.conf sets no RuntimeDirectoryMode=")


LAYOUTS = {
    # docs/ray-serve.md: runtime_dir the daemon's own, traversable by others (stats.sock, mode 666);
    # status.sock in a directory of its own whose group is Ray's (the setgid bit hands it on).
    "documented": {
        "runtime": (DAEMON.uid, DAEMON.gid, _ray_node_runtime_mode()),
        "status": (DAEMON.uid, RAY_GROUP, 0o2750),
    },
    # The layout docs/ray-serve.md gave before: runtime_dir <daemon>:ray 2750, status.sock inside it.
    "old <daemon>:ray 2750": {"runtime": (DAEMON.uid, RAY_GROUP, 0o2750), "status": None},
}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the bridge as another user")
@pytest.mark.parametrize("layout", LAYOUTS)
async def test_who_may_hand_a_config_over_is_decided_by_file_permissions(rundir: Path, layout: str):
    """The daemon runs as a user of its own, in Ray's group. A bridge in Ray's group hands its
    config over and relays Ray's admin.sock to the worker's stats.sock; the same bridge outside
    the group reaches nothing. Ray's user must not reach the master CLI: in the documented
    layout it cannot; the control, the old layout, lets it."""
    python = _python_for(NOBODY, RAY_GROUP)
    if python is None or _python_for(DAEMON.uid, DAEMON.gid) != python:
        pytest.skip("no python here that an unprivileged user may run with this checkout's packages")
    daemon = dataclasses.replace(DAEMON, python=python, pythonpath=tuple(_checkout_paths()))
    rundir.chmod(0o755)
    runtime = _make_dir(rundir / "d" / "run", *LAYOUTS[layout]["runtime"])
    status_dir = LAYOUTS[layout]["status"]
    status = _make_dir(rundir / "d" / "status", *status_dir) if status_dir else runtime
    handover = _make_dir(rundir / "handover", NOBODY, RAY_GROUP, 0o750)
    settings = {
        "haproxy": {"config": str(handover / "haproxy.cfg"), "binary": _binary_for(daemon, rundir)},
        "status": {"listen": f"unix:{status / 'status.sock'}"},
    }
    async with ray_node(rundir, settings, run_as=daemon) as node:
        (rundir / "d").chmod(0o755)
        node.daemon.settings_path.chmod(0o644)
        ray_dir = rundir / "haproxy-serve"
        ray_dir.mkdir()
        os.chown(ray_dir, NOBODY, NOBODY)
        assert (status / "status.sock").stat().st_gid == RAY_GROUP  # the setgid bit's doing

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
        running = {psutil.Process(pid).uids().effective for pid in (node.daemon.pid, node.daemon.master_pid())}
        assert running == {DAEMON.uid}
        assert await member.running_pid() == spawn.pid  # admin.sock relayed to <runtime_dir>/stats.sock

        master = _connect_as(runtime / "master.sock", python, NOBODY, RAY_GROUP)
        assert master == ("Permission denied" if layout == "documented" else "connected")
        await member.stop()
