"""The controller sockets' own rules, pure or on plain sockets: what each master-socket word
does, the sockets' settings and owner, the relay's queue for HAProxy's socket, connecting to
a listener whose queue is full, and the pod spec's users."""

from __future__ import annotations

import asyncio
import errno
import socket
from pathlib import Path

import pytest

from supervisor.controller.connections import (
    QueueTimeout,
    UpstreamSlots,
    connect_unix,
    split_line,
    stats_socket_capacity,
)
from supervisor.controller.facade import classify_master_command, master_line_check
from supervisor.files import mode_bits, owner_ids
from supervisor.haproxy.config import Config


def _write(directory, text: str):
    path = directory / "settings.yaml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------- the master socket's words


@pytest.mark.parametrize(
    ("line", "kinds"),
    [
        (b"reload", ["RELOAD"]),
        (b"reload;quit", ["RELOAD", "PASS"]),
        (b"  reload\t", ["RELOAD"]),
        (b"@master reload", ["RELOAD"]),
        (b"@master\t reload ;quit", ["RELOAD", "PASS"]),
        (b"show proc;reload;quit", ["PASS", "RELOAD", "PASS"]),
        # anything else that would start a reload, or another start, in the master: refused
        (b"RELOAD", ["REFUSED"]),
        (b"Reload;quit", ["REFUSED", "PASS"]),
        (b"hard-reload", ["REFUSED"]),
        (b"@master hard-reload;quit", ["REFUSED", "PASS"]),
        (b"@1 reload", ["REFUSED"]),
        (b"@!1234 reload", ["REFUSED"]),
        (b"@@1 reload", ["REFUSED"]),
        (b"@master reload now", ["REFUSED"]),
        (b"re\\load", ["REFUSED"]),
        (b"'reload'", ["REFUSED"]),
        (b'"reload"', ["REFUSED"]),
        (b"show proc\\;reload", ["REFUSED"]),  # one command to us, perhaps two to HAProxy
        (b"_send_status READY --pid 1", ["REFUSED"]),
        (b"mcli-debug-mode on", ["REFUSED"]),
        (b"expert-mode on;reload", ["PASS", "RELOAD"]),
        # passed as they are
        (b"help", ["PASS"]),
        (b"show proc", ["PASS"]),
        (b"@1 show info", ["PASS"]),
        (b"@1 set severity-output number;@1 show info;quit", ["PASS", "PASS", "PASS"]),
        (b"show startup-logs", ["PASS"]),
        (b"prompt", ["PASS"]),
    ],
)
def test_master_words_go_the_daemons_way_are_refused_or_pass(line: bytes, kinds: list[str]) -> None:
    assert [classify_master_command(c).name for c in split_line(line)] == kinds


@pytest.mark.parametrize(
    ("line", "refused"),
    [(b"show proc\n", False), (b"reload\n", True), (b"@master hard-reload\r\n", True), (b"help;RELOAD\n", True)],
)
def test_a_later_line_of_a_relayed_session_is_checked(line: bytes, refused: bool) -> None:
    answer = master_line_check(line)
    assert (answer is not None) == refused
    if answer is not None:
        assert answer.startswith(b"haproxy-supervisor: ") and answer.count(b"\n") == 1, answer


def test_controller_socket_settings(tmp_path) -> None:
    from supervisor.settings import SettingsError, load_settings

    base = "haproxy:\n  move_stats_socket: true\ncontroller:\n  runtime_socket: /r.sock\n"
    defaults = load_settings(_write(tmp_path, base)).controller
    assert (defaults.idle_timeout_s, defaults.queue_timeout_s) == (10, 20)
    assert (defaults.socket_mode, defaults.socket_owner) == ("0660", None)
    chosen = load_settings(_write(tmp_path, base + "  socket_owner: 'nobody:65534'\n  socket_mode: '0600'\n"))
    c = chosen.controller
    assert (mode_bits(c.socket_mode), owner_ids(c.socket_owner)) == (0o600, (65534, 65534))
    for bad, message in [
        ("  socket_mode: '0666'\n", r"controller\.socket_mode: 0666 lets every user in"),
        ("  socket_mode: 'rw'\n", r"controller\.socket_mode: must be an octal mode"),
        ("  socket_owner: 'nobody'\n", r"controller\.socket_owner: must be \"uid:gid\""),
        ("  socket_owner: 'no-such-user-here:0'\n", r"controller\.socket_owner: no user 'no-such-user-here'"),
        ("  idle_timeout_s: 0\n", r"controller\.idle_timeout_s"),
    ]:
        with pytest.raises(SettingsError, match=message):
            load_settings(_write(tmp_path, base + bad))


# ---------------------------------------------------------------- the relay's queue, pure parts


@pytest.mark.parametrize(
    ("global_lines", "capacity"),
    [
        ("", 10),
        ("    stats socket /run/s.sock mode 600 level admin\n", 10),
        ("    stats maxconn 3\n    stats socket /run/s.sock level admin\n", 3),
        ("    stats maxconn 3\n    stats socket /run/s.sock level admin maxconn 40\n", 40),
        ("    stats socket /other.sock maxconn 40\n", 10),
    ],
)
def test_stats_socket_capacity(global_lines: str, capacity: int) -> None:
    config = Config.parse(f"global\n{global_lines}\ndefaults\n    mode http\n")
    assert stats_socket_capacity(config, Path("/run/s.sock")) == capacity


async def test_upstream_slots_queue_in_arrival_order_and_bound_the_wait() -> None:
    slots = UpstreamSlots(lambda: 2, wait_s=0.3)
    order: list[int] = []
    most = 0
    release = asyncio.Event()

    async def caller(i: int) -> None:
        nonlocal most
        async with slots.held():
            most = max(most, slots.in_use)
            order.append(i)
            await release.wait()

    tasks = [asyncio.create_task(caller(i)) for i in range(6)]
    await asyncio.sleep(0.05)
    assert (slots.in_use, len(order)) == (2, 2)  # the other four wait their turn
    release.set()
    await asyncio.gather(*tasks)
    assert order == list(range(6)) and most == 2 and slots.in_use == 0

    async def hold() -> None:
        async with slots.held():
            await asyncio.sleep(1)

    holders = [asyncio.create_task(hold()) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(QueueTimeout, match=r"waited 0\.3s for one of HAProxy's 2 runtime connections"):
        async with slots.held():
            pass
    for task in holders:
        task.cancel()
    await asyncio.gather(*holders, return_exceptions=True)
    assert slots.in_use == 0


# ---------------------------------------------------------------- a listener whose queue is full


def full_listener(directory: Path) -> tuple[socket.socket, Path]:
    """A unix listener with a queue of one that accepts nothing yet: HAProxy's stats socket
    when more callers connect than it accepts."""
    path = directory / "full.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    return listener, path


async def test_control_asyncio_takes_a_full_queue_for_a_connect_in_progress(rundir) -> None:
    """The cause of the relay's `[Errno 22] Invalid argument` (and of `Connection lost`):
    each connection past the queue is handed back unconnected."""
    listener, path = full_listener(rundir)
    failures = []
    try:
        for _ in range(4):
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                async with asyncio.timeout(0.2):
                    await reader.read()
            except TimeoutError:
                pass  # one that waits in the queue
            except OSError as exc:
                failures.append(exc.errno)
            writer.close()
    finally:
        listener.close()
    assert failures and set(failures) == {errno.EINVAL}, failures


async def test_connect_unix_waits_for_the_listener_to_accept(rundir) -> None:
    listener, path = full_listener(rundir)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        queued = [await connect_unix(path, 1) for _ in range(2)]  # the kernel takes one more than the backlog
        late = asyncio.create_task(connect_unix(path, 5))
        await asyncio.sleep(0.1)
        assert not late.done()  # waits, instead of a socket that never connected
        accepted = [(await loop.sock_accept(listener))[0] for _ in range(3)]
        reader, writer = await asyncio.wait_for(late, 5)
        accepted[-1].sendall(b"answer\n")
        accepted[-1].close()
        assert await reader.read() == b"answer\n"
        writer.close()
        with pytest.raises(OSError, match="queue stayed full"):
            await _fill_then_connect(path)
        for _, w in queued:
            w.close()
        for conn in accepted[:-1]:
            conn.close()
    finally:
        listener.close()


async def _fill_then_connect(path: Path) -> None:
    held = [await connect_unix(path, 1) for _ in range(2)]
    try:
        await connect_unix(path, 0.05)
    finally:
        for _, w in held:
            w.close()


def test_the_pod_spec_gives_both_sockets_to_the_controllers_user(tmp_path) -> None:
    """contrib/kubernetes/pod.yaml: the controller's container user is the sockets' owner, and
    the daemon's settings in it load."""
    import yaml

    from supervisor.settings import load_settings

    pod, config_map = yaml.safe_load_all((Path(__file__).parents[1] / "contrib/kubernetes/pod.yaml").read_text())
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    controller = containers["controller"]["securityContext"]
    assert controller["runAsNonRoot"] and "securityContext" in containers["haproxy-supervisor"]
    settings = load_settings(_write(tmp_path, config_map["data"]["config.yaml"])).controller
    assert owner_ids(settings.socket_owner) == (controller["runAsUser"], controller["runAsGroup"])
    assert mode_bits(settings.socket_mode) == 0o600
