"""One daemon per runtime_dir: an exclusive `flock` on `runtime_dir/daemon.lock`, held for the
daemon's whole life.

Two daemons on one runtime_dir would start two HAProxy masters whose workers share the frontend
ports (SO_REUSEPORT), each daemon talking to the other's workers, and each removing the other's
files. The second one stops before it touches anything. The lock goes with the process: a daemon
killed with -9 leaves a file that the next one locks at once. The descriptor is close-on-exec,
so HAProxy (which outlives a detached daemon) never holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from .files import FILE_MODE

LOCK_NAME = "daemon.lock"


class RuntimeDirInUse(OSError):
    """Another process holds the runtime_dir's lock; `holder` is its PID when known."""

    def __init__(self, path: Path, holder: int | None) -> None:
        who = f"the daemon with PID {holder}" if holder is not None else "another process"
        super().__init__(errno.EWOULDBLOCK, f"{path} is locked by {who}: one daemon per runtime_dir")
        self.path = path
        self.holder = holder


def lock_holder(path: Path, fd: int | None = None) -> int | None:
    """The PID that holds the flock on `path`: from /proc/locks (the kernel's word), else the
    PID the holder wrote into the file."""
    try:
        info = os.fstat(fd) if fd is not None else os.stat(path)
        with open("/proc/locks") as f:
            locks = f.read().splitlines()
    except OSError:
        locks = []
    else:
        device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
        for line in locks:
            fields = line.split()
            # "1: FLOCK  ADVISORY  WRITE 1234 00:2b:5678 0 EOF"; a waiter's line has "->" after the number.
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device and fields[4].isdigit():
                return int(fields[4])
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return None


class RuntimeDirLock:
    """`acquire()` once at start-up; the lock lasts until `release()` or the process ends."""

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise RuntimeDirInUse naming the holder (OSError when the file
        cannot be opened). Nothing else in runtime_dir is touched either way."""
        # Held read-only: a descriptor open for writing would stop runtime_dir's filesystem from
        # being remounted read-only (flock needs no write access).
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(self.path, fd)
            os.close(fd)
            raise RuntimeDirInUse(self.path, holder) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # For people and `lock_holder` where /proc/locks is not readable: who holds it.
        with contextlib.suppress(OSError):
            pid = os.open(self.path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(pid, f"{os.getpid()}\n".encode())
            finally:
                os.close(pid)

    def renew(self) -> None:
        """runtime_dir was deleted and made again: lock the new file, so that a second daemon
        started now still finds it taken. The old descriptor keeps the old (unlinked) inode."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self._fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                return
        old, self._fd = self._fd, None
        try:
            self.acquire()
        except OSError:
            self._fd = old  # keep what we had; the caller logs the loss
            raise
        os.close(old)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
