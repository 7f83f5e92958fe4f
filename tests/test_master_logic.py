"""Pure parts of the master's lifecycle: backoff, recognising our own master, exit descriptions."""

from __future__ import annotations

from pathlib import Path

from supervisor.master import (
    describe_exit,
    is_our_master,
    is_our_master_worker,
    master_command,
    next_backoff,
    read_pid_file,
)
from supervisor.settings import HAProxySettings, Settings


def settings() -> Settings:
    return Settings(haproxy=HAProxySettings(runtime_dir=Path("/run/hs"), binary="haproxy"))


def test_backoff_doubles_to_the_cap_and_resets_after_a_stable_run():
    delays = []
    delay = None
    for _ in range(8):
        delay = next_backoff(delay, uptime_s=0.5)
        delays.append(delay)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert next_backoff(30, uptime_s=31) == 1
    assert next_backoff(4, uptime_s=None) == 8


def test_master_command_is_foreground_master_worker():
    cmd = master_command(settings())
    assert cmd == [
        "haproxy", "-W", "-S", "/run/hs/master.sock,mode,660", "-f", "/run/hs/haproxy.cfg", "-p", "/run/hs/haproxy.pid",
    ]
    assert "-D" not in cmd


def test_is_our_master():
    s = settings()
    ours = [
        "/usr/sbin/haproxy", "-W", "-S", "/run/hs/master.sock",
        "-f", "/run/hs/haproxy.cfg", "-p", "/run/hs/haproxy.pid",
    ]
    assert is_our_master(ours, s)
    assert is_our_master(["haproxy", "-W", "-S", "/run/hs/master.sock,mode,600", "-f", "/run/hs/haproxy.cfg"], s)
    other_dir = [a.replace("/run/hs", "/run/other") for a in ours]
    assert not is_our_master(other_dir, s)
    assert not is_our_master(["python3", "-W", "-S", "/run/hs/master.sock", "-f", "/run/hs/haproxy.cfg"], s)
    assert not is_our_master(["haproxy", "-S", "/run/hs/master.sock", "-f", "/run/hs/haproxy.cfg"], s)
    worker = ["haproxy", "-sf", "10822", "-x", "sockpair@3", *ours[1:]]
    assert not is_our_master(worker, s), "a worker's argv is not a master"
    assert is_our_master_worker(worker, s)
    assert is_our_master_worker(["haproxy", "-sf", "1", "2", "3", "-x", "sockpair@3", *ours[1:]], s)
    assert not is_our_master_worker([a.replace("/run/hs", "/run/other") for a in worker], s)


def test_read_pid_file(tmp_path: Path):
    p = tmp_path / "pid"
    assert read_pid_file(p) is None
    p.write_text("1234\n")
    assert read_pid_file(p) == 1234
    p.write_text("garbage")
    assert read_pid_file(p) is None
    p.write_text("0")
    assert read_pid_file(p) is None


def test_describe_exit():
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(None).startswith("exit status unknown")
