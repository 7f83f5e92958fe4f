"""HAProxy's stderr lines as server events (pure parser), and the FIFO relay on a real FIFO."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from supervisor.haproxy.stderr import ServerEvent, StderrRelay, parse_server_event

# Lines as HAProxy 2.6.12, 2.8.25, 3.0.11 and 3.4.0 wrote them in master-worker mode.
SEEN = [
    ('[WARNING]  (8515) : Server b/s1 is DOWN, reason: Layer4 connection problem, info: "Connection refused", '
     "check duration: 0ms. 0 active and 0 backup servers left. 0 sessions active, 0 requeued, 0 remaining in queue.",
     ServerEvent(8515, "b", "s1", "DOWN")),
    ("[WARNING]  (21053) : Backup Server b/s2 is UP, reason: Layer4 check passed, check duration: 0ms. 1 active "
     "and 1 backup servers online. 0 sessions requeued, 0 total in queue.",
     ServerEvent(21053, "b", "s2", "UP")),
    ('[WARNING]  (8881) : Server b/s1 is DOWN, reason: Layer4 connection problem, info: "ECONNREFUSED returned by '
     'OS (Connection refused)", check duration: 0ms. 0 active and 0 backup servers left.',
     ServerEvent(8881, "b", "s1", "DOWN")),
    ("[WARNING]  (77) : Server app_1/r-9.x:80 is going DOWN for maintenance. 1 active and 0 backup servers left.",
     ServerEvent(77, "app_1", "r-9.x:80", "MAINT")),
    ("[WARNING]  (77) : Server be/s was DOWN and now enters maintenance.", ServerEvent(77, "be", "s", "MAINT")),
    ("[WARNING]  (77) : Server be/s is UP/READY (leaving forced maintenance).", ServerEvent(77, "be", "s", "UP")),
    ("[WARNING]  (77) : Server be/s ('db.local') is UP/READY (resolves again).", ServerEvent(77, "be", "s", "UP")),
    ("[NOTICE]   (77) : Server be/s enters drain state.", ServerEvent(77, "be", "s", "DRAIN")),
    ("[ALERT]    (77) : Server be/s is DOWN, reason: Health analyze, info: \"Layer4 error\".\n",
     ServerEvent(77, "be", "s", "DOWN")),
    ("[WARNING]  (77) : Server be/s changed its IP from 10.0.0.1 to 10.0.0.2 by DNS cache.",
     ServerEvent(77, "be", "s", "CHANGED")),
]


@pytest.mark.parametrize(("line", "event"), SEEN)
def test_a_server_state_line_is_an_event_of_the_process_that_wrote_it(line, event):
    assert parse_server_event(line) == event


@pytest.mark.parametrize(
    "line",
    [
        "[NOTICE]   (8513) : New worker (8515) forked",
        "[NOTICE]   (8513) : Loading success.",
        "[ALERT]    (8515) : backend 'b' has no server available!",
        "[WARNING]  (21053) : Proxy b stopped (cumulated conns: FE: 0, BE: 1).",
        "[WARNING]  (21032) : Former worker (21053) exited with code 0 (Exit)",
        "Server b/s1 is DOWN",  # no prefix: not HAProxy's
        "[WARNING]  (x1) : Server b/s1 is DOWN",
        "[WARNING]  (77) : Server b/s;show;x is DOWN",  # a name that could not reach the CLI
        "[WARNING]  (77) : Health check for server b/s1 failed, reason: Layer4 timeout",
        "",
    ],
)
def test_other_lines_are_no_event(line):
    assert parse_server_event(line) is None


async def _read_until(fd: int, wanted: bytes, timeout: float = 2.0) -> bytes:
    got = b""
    deadline = asyncio.get_running_loop().time() + timeout
    while wanted not in got:
        try:
            got += os.read(fd, 65536)
        except BlockingIOError:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{wanted!r} not forwarded; got {got!r}") from None
            await asyncio.sleep(0.01)
    return got


async def test_the_relay_forwards_whole_lines_unchanged_and_turns_server_lines_into_events(tmp_path):
    forward_r, forward_w = os.pipe()
    os.set_blocking(forward_r, False)
    relay = StderrRelay(tmp_path / "haproxy.stderr", forward_fd=forward_w)
    events: list[ServerEvent] = []
    relay.subscribe(events.append)
    relay.open()
    writer = relay.write_end()
    try:
        line = SEEN[0][0].encode() + b"\n"
        os.write(writer, b"[NOTICE]   (1) : New worker (2) forked\n" + line[:30])
        await _read_until(forward_r, b"forked\n")
        await asyncio.sleep(0.05)
        assert events == []  # half a line: neither forwarded nor parsed yet
        os.write(writer, line[30:])
        assert await _read_until(forward_r, b"queue.\n") == line
        assert events == [SEEN[0][1]]
    finally:
        os.close(writer)
        relay.close()
        os.close(forward_r)
        os.close(forward_w)


async def test_a_restarted_relay_reopens_the_fifo_a_running_writer_still_holds(tmp_path):
    """The write end a master holds survives the daemon: a new relay on the same path hears it."""
    path = tmp_path / "haproxy.stderr"
    first = StderrRelay(path, forward_fd=os.open(os.devnull, os.O_WRONLY))
    first.open()
    writer = first.write_end()
    try:
        first.close()  # the daemon went away: no reader left
        with pytest.raises(OSError) as raised:
            os.write(writer, b"[WARNING]  (5) : Server b/s is DOWN\n")
        assert raised.value.errno == errno.EPIPE  # lost, and the writer is not blocked (nor killed: SIGPIPE
        # is ignored by Python here as HAProxy ignores it)
        second = StderrRelay(path, forward_fd=os.open(os.devnull, os.O_WRONLY))
        events: list[ServerEvent] = []
        second.subscribe(events.append)
        second.open()
        try:
            assert second.feeds(os.getpid()) is False  # our own stderr is not the FIFO
            os.write(writer, b"[WARNING]  (5) : Server b/s is UP\n")
            for _ in range(100):
                if events:
                    break
                await asyncio.sleep(0.01)
            assert events == [ServerEvent(5, "b", "s", "UP")]
        finally:
            second.close()
    finally:
        os.close(writer)


async def test_a_full_fifo_drops_a_line_instead_of_blocking_the_writer_and_the_relay_says_so(tmp_path):
    """A refused line leaves no trace in the pipe; the read after it finds the pipe full, and the
    listeners hear None (read the states again) before the lines that were kept."""
    relay = StderrRelay(tmp_path / "haproxy.stderr", forward_fd=os.open(os.devnull, os.O_WRONLY))
    heard: list[ServerEvent | None] = []
    relay.subscribe(heard.append)
    relay.open()
    writer = relay.write_end()
    try:
        line = b"[WARNING]  (5) : Server b/s is DOWN, reason: " + b"x" * 3900 + b"\n"
        written = 0
        for _ in range(2000):  # no await in between: the relay cannot read; the pipe holds 1 MB
            try:
                os.write(writer, line)
                written += 1
            except BlockingIOError:
                break
        assert 0 < written < 2000  # a line was refused, and the writer was not blocked
        for _ in range(200):
            if len([e for e in heard if e is not None]) == written:
                break
            await asyncio.sleep(0.01)
        assert heard[0] is None
        assert [e for e in heard if e is not None] == [ServerEvent(5, "b", "s", "DOWN")] * written
        assert heard[-1] is not None  # each read that finds it over half full says so, not the last
    finally:
        os.close(writer)
        relay.close()
