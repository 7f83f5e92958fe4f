"""sd_notify: message format, addresses (paths and abstract names), watchdog interval, a real socket."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from supervisor.haproxy.config import Config
from supervisor.notify import (
    Notifier,
    child_environment,
    format_message,
    notify_address,
    summary_line,
    watchdog_interval,
)
from supervisor.state import Generation, State, utcnow


def test_addresses():
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@abc") == b"\0abc"
    assert notify_address("") is None
    assert notify_address("vsock:2:1") is None


def test_watchdog_interval():
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}, 5) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "5"}, 5) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "6"}, 5) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}, 5) is None
    assert watchdog_interval({}, 5) is None


def test_format_message_keeps_fields_on_one_line():
    assert format_message(READY=1, STATUS="a\nb") == b"READY=1\nSTATUS=a b"


def test_child_environment_drops_notify_variables():
    env = child_environment({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


def test_summary_line():
    state = State()
    assert summary_line(state).startswith("haproxy master down")
    state.master_pid, state.master_up = 10, True
    state.generations[3] = Generation(3, Config.parse(""), "e", "r", utcnow(), 1234)
    state.current_generation = 3
    state.reloads.record("ok", 1.0)
    state.reloads.record("invalid", 1.0, "[ALERT] bad\nmore")
    line = summary_line(state, old_workers=2)
    assert line.startswith("generation 3 worker 1234; old workers 2; reloads ok 1 failed 0 invalid 1")
    assert line.endswith("last invalid: [ALERT] bad") and "\n" not in line


def receive_all(sock: socket.socket) -> list[dict[str, str]]:
    messages = []
    while True:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return messages
        messages.append(dict(line.split("=", 1) for line in data.decode().split("\n")))


@pytest.mark.parametrize("abstract", [False, True])
def test_messages_reach_a_real_datagram_socket(rundir: Path, abstract: bool):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"@hs-notify-{os.getpid()}-{time.monotonic_ns()}" if abstract else str(rundir / "notify")
    sock.bind("\0" + name[1:] if abstract else name)
    sock.setblocking(False)
    try:
        n = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "2000000"})
        assert n.address is not None and n.watchdog_s == 1.0
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        n.ready("generation 1")
        n.reloading("reloading: SIGHUP")
        n.send(WATCHDOG=1)
        n.stopping()
        n.close()
        got = receive_all(sock)
    finally:
        sock.close()
    assert got[0] == {"READY": "1", "STATUS": "generation 1"}
    assert got[1]["RELOADING"] == "1" and int(got[1]["MONOTONIC_USEC"]) >= before
    assert int(got[1]["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert got[2] == {"WATCHDOG": "1"}
    assert got[3]["STOPPING"] == "1"


def test_without_notify_socket_everything_is_a_no_op():
    n = Notifier({})
    assert n.address is None
    assert not n.send(READY=1)
    n.ready("x")


def test_a_vanished_socket_does_not_raise(rundir: Path):
    n = Notifier({"NOTIFY_SOCKET": str(rundir / "gone")})
    assert not n.send(READY=1)
    assert not n.send(READY=1)
