"""HAProxy's messages as events: the master's stderr is a named FIFO (found again by a restarted
daemon, docs/operating.md) where each process reports the server state changes it sees. Its
write end is O_NONBLOCK (a daemon that stops reading never stalls a worker: a full pipe drops a
line, and the next read, finding it full, tells listeners None, "read the states again"), the
daemon's end read-write (no end of file); every line goes on unchanged to the daemon's stderr."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import stat
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .answers import ServerKey

log = logging.getLogger(__name__)

ServerChange = Literal["DOWN", "UP", "MAINT", "DRAIN", "CHANGED"]

# `[WARNING]  (4612) : Backup Server be/s1 ('host') is DOWN, reason: ...`; the level is padded.
_SERVER_LINE = re.compile(
    r"\A\[(?:WARNING|NOTICE|ALERT)\]\s+\((\d+)\) : (?:Backup )?Server ([^\s/]+)/(\S+) (?:\('[^']*'\) )?(.*)\Z"
)
_CHANGES: tuple[tuple[str, ServerChange], ...] = (
    ("is DOWN", "DOWN"),
    ("is going DOWN for maintenance", "MAINT"),
    ("was DOWN and now enters maintenance", "MAINT"),
    ("enters maintenance", "MAINT"),
    ("is UP", "UP"),
    ("enters drain", "DRAIN"),
    ("is stopping", "DRAIN"),
)
PIPE_BYTES = 1 << 20  # room for a burst (thousands of servers going DOWN at once) before lines drop
_READ_BYTES = 1 << 16
_MAX_PARTIAL = 1 << 16  # a "line" longer than this without a newline is passed on as it is
# HAProxy writes a message whole or not at all, and a pipe is full when its pages are: a page
# a line did not fit in is left part empty. Only the daemon takes bytes out, so the read after a
# refused line finds the pipe at least this full, for any line shorter than half a page.
_FULL_SHARE = 0.5


@dataclass(frozen=True)
class ServerEvent:
    """A server changed state in the view of process `pid`."""

    pid: int
    backend: str
    server: str
    change: ServerChange

    @property
    def key(self) -> ServerKey:
        return ServerKey.of(self.backend, self.server)


def parse_server_event(line: str) -> ServerEvent | None:
    """The server state change one stderr line reports, or None (also for names the CLI refuses)."""
    m = _SERVER_LINE.match(line.rstrip("\r\n"))
    if m is None:
        return None
    pid, backend, server, rest = m.groups()
    try:
        ServerKey.checked(backend, server)
    except ValueError:
        return None
    change = next((c for prefix, c in _CHANGES if rest.startswith(prefix)), "CHANGED")
    return ServerEvent(int(pid), backend, server, change)


class StderrRelay:
    """The FIFO that is the master's stderr: made, read, forwarded, and turned into events."""

    def __init__(self, path: Path, forward_fd: int = 2) -> None:
        self.path = path
        self.forward_fd = forward_fd
        self._fd: int | None = None
        self._partial = b""
        self._capacity = 0
        self._full = False
        self._listeners: list[Callable[[ServerEvent | None], None]] = []

    def subscribe(self, listener: Callable[[ServerEvent | None], None]) -> None:
        """`listener` hears each server event, and None when lines may have been lost."""
        self._listeners.append(listener)

    def open(self) -> None:
        """Make the FIFO (or keep the one an adopted master writes to) and start reading it."""
        try:
            if not stat.S_ISFIFO(os.lstat(self.path).st_mode):
                self.path.unlink()
                os.mkfifo(self.path, 0o600)
        except FileNotFoundError:
            os.mkfifo(self.path, 0o600)
        fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # a bigger pipe is a comfort, not a need
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        self._fd = fd
        asyncio.get_running_loop().add_reader(fd, self._readable)

    def close(self) -> None:
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None

    def write_end(self) -> int:
        """A write end for a master about to start (the caller closes it once it is passed on)."""
        return os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)

    def feeds(self, pid: int) -> bool:
        """Whether process `pid` writes its stderr into this FIFO (not a master started by hand)."""
        try:
            if self._fd is None:
                return False
            theirs, ours = os.stat(f"/proc/{pid}/fd/2"), os.fstat(self._fd)
            return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
        except OSError:
            return False

    def _readable(self) -> None:
        assert self._fd is not None
        unread = struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        try:
            chunk = os.read(self._fd, _READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        full, self._full = self._full, unread > self._capacity * _FULL_SHARE
        if self._full:
            if not full:
                log.warning("HAProxy's stderr FIFO is full: lines may be lost, the server states are read again")
            self._tell(None)  # each time: a line refused after the read this one calls for
        data = self._partial + chunk
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) > _MAX_PARTIAL:
            end = len(data)
        self._partial = data[end:]
        if end:
            self._forward(data[:end])
            self._dispatch(data[:end])

    def _forward(self, lines: bytes) -> None:
        # Whole lines only: the daemon's own log lines go to the same stream.
        with contextlib.suppress(OSError):
            view = memoryview(lines)
            while view:
                view = view[os.write(self.forward_fd, view) :]

    def _dispatch(self, lines: bytes) -> None:
        if b"Server " not in lines:
            return
        for line in lines.decode(errors="replace").splitlines():
            event = parse_server_event(line)
            if event is not None:
                self._tell(event)

    def _tell(self, event: ServerEvent | None) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("a listener of HAProxy's server events failed")
