"""Pure parts of the master's lifecycle: backoff, recognising our own master, exit descriptions."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from supervisor.haproxy.config import Config
from supervisor.master.process import HEALTHY_UPTIME_S, bind_ports, listening_ports, master_command, next_backoff
from supervisor.master.processes import (
    describe_exit,
    is_our_master,
    is_our_master_worker,
    master_socket_candidates,
    read_pid_file,
    socket_inodes,
    still_open,
)
from supervisor.settings import HAProxySettings, Settings


def settings() -> Settings:
    return Settings(haproxy=HAProxySettings(runtime_dir=Path("/run/hs"), binary="haproxy"))


def test_backoff_restarts_at_once_then_doubles_to_the_cap_and_resets_after_a_healthy_run():
    delays = []
    delay = None
    for _ in range(8):
        delay = next_backoff(delay, uptime_s=0.5)
        delays.append(delay)
    assert delays == [0, 1, 2, 4, 8, 16, 30, 30]
    assert next_backoff(30, uptime_s=HEALTHY_UPTIME_S) == 0
    assert next_backoff(30, uptime_s=HEALTHY_UPTIME_S - 1) == 30
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


# /proc/net/unix on 3.4.0 after two reloads: the master (pid 9417) binds `<path>.<pid>.tmp` and
# renames it; the name stays after re-exec and after the file is removed. Its argv then reads
# `haproxy -sf 9425 -x sockpair@4 -W -S ...`, so the socket, not the argv, says which is ours.
NET_UNIX = """\
Num       RefCount Protocol Flags    Type St Inode Path
00000000d8f6ef1c: 00000002 00000000 00010000 0001 01 38751 /run/hs/master.sock.9417.tmp
00000000d8f6ef1d: 00000002 00000000 00010000 0001 01 38752 /run/hs/stats.sock.9417.tmp
00000000d8f6ef1e: 00000003 00000000 00000000 0001 03 38753 /run/hs/master.sock.9417.tmp
00000000d8f6ef1f: 00000002 00000000 00010000 0001 01 38754 /run/other/master.sock.7000.tmp
00000000d8f6ef20: 00000002 00000000 00010000 0001 01 38755 /run/hs/master.sock
00000000d8f6ef21: 00000002 00000000 00010000 0001 01 38756 /run/hs/master.sock.x.tmp
00000000d8f6ef22: 00000002 00000000 00010000 0001 01 38757
"""


def test_master_socket_candidates_are_our_listeners_with_the_pid_that_bound_them():
    assert master_socket_candidates(NET_UNIX, Path("/run/hs/master.sock")) == [(38751, 9417), (38755, None)]
    assert master_socket_candidates(NET_UNIX, Path("/run/nothing/master.sock")) == []


def test_bind_ports():
    config = Config.parse(
        "global\n    stats socket /run/hs/stats.sock\n"
        "frontend fe\n    bind 127.0.0.1:8080\n    bind :8443,ipv6@[::1]:8444 ssl crt x.pem\n"
        "    bind unix@/run/hs/fe.sock\n    bind 127.0.0.1:9000-9010\n    bind quic4@:443\n"
        "listen stats\n    bind 127.0.0.1:9100\n"
        "backend be\n    server s 127.0.0.1:80\n"
    )
    assert bind_ports(config) == {8080, 8443, 8444, 9100}


def test_listening_ports_are_the_kernels_listeners_held_by_the_process():
    with socket.socket() as listener, socket.socket() as bound_only, socket.socket(socket.AF_INET6) as six:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        bound_only.bind(("127.0.0.1", 0))  # bound, not listening: accepts nothing
        six.bind(("::1", 0))
        six.listen(1)
        port = listener.getsockname()[1]
        ports = listening_ports(os.getpid())
        assert ports is not None
        assert port in ports and six.getsockname()[1] in ports
        assert bound_only.getsockname()[1] not in ports
    assert port not in (listening_ports(os.getpid()) or set()), "closed: no longer listening"
    assert listening_ports(1) is not None and port not in (listening_ports(1) or set()), "not pid 1's"


def test_a_socket_is_still_open_until_its_descriptor_is_closed():
    sock = socket.socket()
    inode = os.fstat(sock.fileno()).st_ino
    held = socket_inodes(os.getpid())
    assert held[inode] == sock.fileno()
    assert still_open(os.getpid(), {inode: held[inode]}) == {inode: held[inode]}
    sock.close()
    assert still_open(os.getpid(), {inode: held[inode]}) == {}
    reused = socket.socket()  # the same descriptor number, another socket
    try:
        assert still_open(os.getpid(), {inode: held[inode]}) == {}
    finally:
        reused.close()
