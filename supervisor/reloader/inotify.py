"""Linux inotify through libc (ctypes), read on the event loop: no thread, no polling at rest.

The kernel tells a completed write (IN_CLOSE_WRITE) from a write in progress (IN_MODIFY), and a
rename into place (IN_MOVED_TO) from a file being created: what "the input changed" must mean.
`parse_events` is pure; `Inotify` is the thin shell around the descriptor.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000

IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


@dataclass(frozen=True)
class Event:
    wd: int
    mask: int
    cookie: int
    name: str  # "" for an event on the watched directory itself


def parse_events(data: bytes) -> list[Event]:
    """The events in one read of an inotify descriptor (names are NUL-padded)."""
    events = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        wd, mask, cookie, length = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        raw = data[offset : offset + length]
        offset += length
        events.append(Event(wd, mask, cookie, os.fsdecode(raw.split(b"\0", 1)[0])))
    return events


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.inotify_init1.argtypes = [ctypes.c_int]
    libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


class Inotify:
    """One inotify descriptor; `start(callback)` calls back with each read's events on the loop."""

    def __init__(self) -> None:
        self._lib = _libc()
        fd = self._lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd: int = fd
        self.watches: dict[int, Path] = {}  # wd -> the directory it watches
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, directory: Path, mask: int) -> int:
        wd = self._lib.inotify_add_watch(self.fd, os.fsencode(directory), mask | IN_ONLYDIR | IN_DONT_FOLLOW)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(directory))
        self.watches[wd] = directory
        return wd

    def remove(self, wd: int) -> None:
        self._lib.inotify_rm_watch(self.fd, wd)  # EINVAL for a watch the kernel dropped already
        self.watches.pop(wd, None)

    def start(self, callback: Callable[[list[Event]], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.fd, self._readable, callback)

    def _readable(self, callback: Callable[[list[Event]], None]) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        callback(parse_events(data))

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
            self._loop = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.watches.clear()
