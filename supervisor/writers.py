"""Reading a file only once its writer is done with it.

A controller that rewrites the rendered config in place, in chunks, leaves partial configs on
disk between them, and a chunk that ends with a section leaves a valid one. The file is read
only when no other process:
- holds an exclusive `flock` on `<file>.lock` beside it (Ray Serve's convention) or on the file;
- holds a POSIX write lock (`fcntl`/`lockf`) on either;
- has the file open for writing. The kernel says so without a scan of /proc: a read lease
  (F_SETLEASE F_RDLCK) is refused while any process has it open for writing. The lease is
  dropped at once: it is a question, not a hold (holding one would make a writer's open wait,
  and bring SIGIO to this process).
The shared flocks are held while the bytes are read, so a writer that locks cannot start
meanwhile; the lease and the POSIX locks are asked again after the read, and the file's stat
must not have changed in between. A lease needs the file's owner or CAP_LEASE: without them
that one question is skipped, and only completed writes (inotify) and locks protect the read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from .files import DEFAULT_MAX_READ_BYTES, UnreadableFile, read_regular

F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
# struct flock on Linux (x86_64, aarch64): l_type, l_whence, l_start, l_len, l_pid.
_FLOCK = struct.Struct("hh4xqqi4x")


class WriterBusy(Exception):
    """Another process is writing the file, or holds its writer's lock; the message says which."""


def lock_file(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _posix_write_lock(fd: int) -> int | None:
    """The PID holding a POSIX (or OFD) write lock on any byte of the file, or None."""
    probe = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, probe)
    except OSError:
        return None
    l_type, _, _, _, pid = _FLOCK.unpack(answer)
    return None if l_type == fcntl.F_UNLCK else (pid if pid > 0 else -1)


def open_for_writing(fd: int) -> bool | None:
    """Does any process have this file open for writing? None when the kernel will not say
    (not the owner and no CAP_LEASE, a filesystem without leases)."""
    try:
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EBUSY):
            return True
        return None
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
    return False


def _who(pid: int | None) -> str:
    return "another process" if pid is None or pid < 0 else f"PID {pid}"


@contextlib.contextmanager
def _shared_flock(path: Path, required: bool) -> Iterator[int | None]:
    """A shared flock on `path` for the block; WriterBusy while someone holds it exclusively.
    A missing lock file is no lock (unless `required`: then the caller's read fails itself)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        if required:
            raise
        yield None
        return
    try:
        _share_flock(fd, path)
        yield fd
    finally:
        os.close(fd)


def _share_flock(fd: int, path: Path) -> None:
    """A shared flock on `fd`; WriterBusy while a writer holds it exclusively."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise WriterBusy(f"{path} is locked by its writer (flock)") from None
    except OSError:
        pass  # a filesystem without flock: nothing to honour there


def _writer_of(path: Path, fd: int, lock_fd: int | None) -> str | None:
    """Why the file is not whole now, or None."""
    for which, descriptor in ((lock_file(path), lock_fd), (path, fd)):
        if descriptor is not None and (pid := _posix_write_lock(descriptor)) is not None:
            return f"{which} is locked by its writer ({_who(pid)}, fcntl)"
    if open_for_writing(fd):
        return f"{path} is open for writing by another process"
    return None


def _stat_key(fd: int) -> tuple[int, ...]:
    info = os.fstat(fd)
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def read_whole(path: Path, limit: int = DEFAULT_MAX_READ_BYTES) -> bytes:
    """The file's bytes as its writer finished them: WriterBusy while a writer holds a lock or
    the file open for writing (see the module's docstring); UnreadableFile / OSError as
    `read_regular`."""
    with _shared_flock(lock_file(path), required=False) as lock_fd:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as exc:
            raise UnreadableFile(exc.errno, exc.strerror) from None
        try:
            _share_flock(fd, path)
            if (why := _writer_of(path, fd, lock_fd)) is not None:
                raise WriterBusy(why)
            before = _stat_key(fd)
            data = read_regular(path, limit)
            if (why := _writer_of(path, fd, lock_fd)) is not None:
                raise WriterBusy(why)
            if _stat_key(fd) != before or os.stat(path).st_ino != before[0]:
                raise WriterBusy(f"{path} changed while it was read")
            return data
        finally:
            os.close(fd)
