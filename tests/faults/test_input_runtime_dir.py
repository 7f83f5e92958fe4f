"""runtime_dir trust, end to end (issue 13, item 9): under umask 000 nothing the daemon or
HAProxy creates there is open to other users (master.sock above all: it can make workers
answer 503); a runtime_dir others may write in is refused in one line; symlinks planted
there are replaced, never written through."""

from __future__ import annotations

import os
import stat

import pytest

from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port, wait_for

pytestmark = pytest.mark.haproxy


async def test_under_umask_000_nothing_in_runtime_dir_is_open_to_others(make):
    front = free_port()
    with backends("b1") as started:
        d = make(config(front, started["b1"].address, "t"))
        previous = os.umask(0)
        try:
            d.start()  # the daemon, and HAProxy after it, inherit umask 000
        finally:
            os.umask(previous)
        await d.wait_generation(1)
        run = d.runtime
        paths = [run, run / "master.sock", run / "steer.map", run / "server-state", run / "haproxy.cfg",
                 run / "generations", run / "generations.json", run / "haproxy.pid", *run.glob("generations/*.cfg")]
        # generations.json follows the generation's first log line by a moment.
        wait_for(lambda: all(p.exists() for p in paths), what=" and ".join(p.name for p in paths))
        modes = {p.name: stat.S_IMODE(os.lstat(p).st_mode) for p in paths}
        assert not {name: oct(m) for name, m in modes.items() if m & 0o002}, "world-writable"
        sock = modes["master.sock"]
        assert sock & 0o007 == 0, f"master.sock is {sock:04o}: any local user may connect"
        assert not {name: oct(m) for name, m in modes.items() if m & 0o020 and name != "master.sock"}


async def test_a_runtime_dir_others_may_write_in_is_refused(make):
    d = make(config(free_port(), "127.0.0.1:9", "t"))
    d.runtime.mkdir()
    os.chmod(d.runtime, 0o777)
    d.start()
    assert await d.wait_exit() == 1
    lines = [line for line in d.run_log().splitlines() if "runtime_dir" in line and "ERROR" in line]
    assert len(lines) == 1 and "mode 0777 lets other users write in it" in lines[0], d.run_log()
    assert "Traceback" not in d.run_log()
    assert not (d.runtime / "master.sock").exists()


async def test_planted_symlinks_in_runtime_dir_are_not_followed(make, tmp_path):
    front = free_port()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    with backends("b1") as started:
        d = make(config(front, started["b1"].address, "t"))
        d.runtime.mkdir(mode=0o700)
        for name in ("steer.map", "server-state", "haproxy.cfg"):
            (d.runtime / name).symlink_to(victim)
        d.start()
        await d.wait_generation(1)
        assert victim.read_text() == "precious\n"
        for name in ("steer.map", "server-state", "haproxy.cfg"):
            assert stat.S_ISREG(os.lstat(d.runtime / name).st_mode), name
