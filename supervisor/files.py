"""Reading and writing the files the daemon trusts, safely: reads take only regular files up to a
limit (a FIFO would block); writes go to runtime_dir, one daemon's (`RuntimeDirLock`), never through
a symlink; `read_whole` waits for a writer to finish (docs/inputs.md)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import socket
import stat
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

# The rendered config's default limit: far above a 100,000-backend config, far below memory trouble.
DEFAULT_MAX_READ_BYTES = 256 * 1024 * 1024
FILE_MODE = 0o640
DIR_MODE = 0o750


class UnreadableFile(OSError):
    """A file that must not or cannot be read; strerror is one line saying why."""


_KINDS = {
    stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_regular(path: Path, limit: int = DEFAULT_MAX_READ_BYTES) -> bytes:
    """The bytes of a regular file no larger than `limit`; UnreadableFile otherwise. Opened
    non-blocking, so a FIFO swapped in after the stat cannot block."""
    try:
        before = os.stat(path)
    except OSError as exc:
        raise UnreadableFile(exc.errno, exc.strerror) from None
    if not stat.S_ISREG(before.st_mode):
        raise UnreadableFile(errno.EINVAL, f"{_kind(before.st_mode)}, not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile(errno.EINVAL, f"{_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise UnreadableFile(errno.EFBIG, f"{info.st_size} bytes, more than the limit of {limit}")
        chunks = []
        total = 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew while being read
                raise UnreadableFile(errno.EFBIG, f"more than the limit of {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def ensure_private_dir(path: Path) -> None:
    """Create `path` with DIR_MODE, or raise UnsafeDirectory unless it is ours and only ours to write."""
    with contextlib.suppress(FileExistsError):
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE)  # mkdir's mode went through the umask
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        info = os.stat(path)  # a symlink to a directory of our own is fine: the target is checked
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(errno.ENOTDIR, f"{_kind(info.st_mode)}, not a directory")
    uid = os.geteuid()
    if info.st_uid != uid:
        raise UnsafeDirectory(errno.EPERM, f"owned by uid {info.st_uid}, not by this daemon's uid {uid}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(
            errno.EPERM, f"mode {stat.S_IMODE(info.st_mode):04o} lets other users write in it; chmod go-w it"
        )


class UnsafeDirectory(OSError):
    """A directory the daemon must not write in; strerror is one line saying why."""


def write_new(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Replace `path` with `data` by renaming a new, fsynced file over it; no planted name or symlink is followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # os.open's mode went through the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_if_missing(path: Path, data: bytes) -> None:
    """Put `data` at `path` unless a regular file is there; a planted symlink is replaced, not followed."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            return
    write_new(path, data)


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`, never through a symlink, with FILE_MODE whatever the umask."""
    write_new(path, text.encode())


def bind_unix_private(path: Path, mode: int) -> socket.socket:
    """A unix stream socket at `path` never wider than `mode`: bind() creates it 0777 & ~umask."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        previous = os.umask(0o777 & ~mode)
        try:
            sock.bind(str(path))
        finally:
            os.umask(previous)
        os.chmod(path, mode)
    except BaseException:
        sock.close()
        raise
    return sock


def mode_bits(mode: str) -> int:
    """An octal mode for a socket only its owner and group may use ("0600", "660"); else ValueError."""
    if not (mode.isascii() and 0 < len(mode) <= 4 and all(c in "01234567" for c in mode)):
        raise ValueError(f"must be an octal mode like \"0600\", got {mode!r}")
    if int(mode, 8) & 0o007:
        raise ValueError(f"{mode} lets every user in; give others no bits")
    return int(mode, 8)


def owner_ids(owner: str) -> tuple[int, int]:
    """The (uid, gid) of "user:group", each a number or a name; ValueError naming what does not resolve."""
    user, sep, group = owner.partition(":")
    if not sep or not user or not group:
        raise ValueError(f"must be \"uid:gid\" (numbers or names), got {owner!r}")
    return _resolved(user, "user", lambda name: pwd.getpwnam(name).pw_uid), \
        _resolved(group, "group", lambda name: grp.getgrnam(name).gr_gid)


def _resolved(name: str, what: str, look_up: Callable[[str], int]) -> int:
    if name.isascii() and name.isdigit():
        return int(name)
    try:
        return look_up(name)
    except KeyError:
        raise ValueError(f"no {what} {name!r}") from None


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
    """Does any process have this file open for writing? None when the kernel will not say. The read
    lease is dropped at once: held, it makes a writer's open wait."""
    try:
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EBUSY):
            return True
        return None
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
    return False


@contextlib.contextmanager
def _shared_flock(path: Path, required: bool) -> Iterator[int | None]:
    """A shared flock on `path` for the block, or WriterBusy. A missing file is no lock, unless `required`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if required:
            raise UnreadableFile(exc.errno, exc.strerror) from None
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WriterBusy(f"{path} is locked by its writer (flock)") from None
        except OSError:
            pass  # a filesystem without flock: nothing to honour there
        yield fd
    finally:
        os.close(fd)


def _refuse_while_written(path: Path, fd: int, lock_fd: int | None) -> None:
    for which, descriptor in ((lock_file(path), lock_fd), (path, fd)):
        if descriptor is not None and (pid := _posix_write_lock(descriptor)) is not None:
            who = "another process" if pid < 0 else f"PID {pid}"
            raise WriterBusy(f"{which} is locked by its writer ({who}, fcntl)")
    if open_for_writing(fd):
        raise WriterBusy(f"{path} is open for writing by another process")


def _stat_key(fd: int) -> tuple[int, ...]:
    info = os.fstat(fd)
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def read_whole(path: Path, limit: int = DEFAULT_MAX_READ_BYTES) -> bytes:
    """The file's bytes, or WriterBusy while a writer holds a lock or has it open for writing: one
    rewritten in place in chunks is valid between them more often than not."""
    with _shared_flock(lock_file(path), required=False) as lock_fd, _shared_flock(path, required=True) as fd:
        assert fd is not None
        _refuse_while_written(path, fd, lock_fd)
        before = _stat_key(fd)
        data = read_regular(path, limit)
        _refuse_while_written(path, fd, lock_fd)
        if _stat_key(fd) != before or os.stat(path).st_ino != before[0]:
            raise WriterBusy(f"{path} changed while it was read")
        return data


class RuntimeDirInUse(OSError):
    """Another process holds the runtime_dir's lock; the message names its PID when known."""

    def __init__(self, path: Path, holder: int | None) -> None:
        who = f"the daemon with PID {holder}" if holder is not None else "another process"
        super().__init__(errno.EWOULDBLOCK, f"{path} is locked by {who}: one daemon per runtime_dir")


def lock_holder(path: Path, fd: int) -> int | None:
    """The PID that holds the flock on `path`: from /proc/locks, else the PID written in the file."""
    try:
        info = os.fstat(fd)
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
    """An exclusive flock on `runtime_dir/daemon.lock` for the daemon's life (two daemons would run two
    masters on the same ports), close-on-exec so HAProxy never holds it."""

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise RuntimeDirInUse naming the holder."""
        # Read-only: a descriptor open for writing would stop the filesystem's read-only remount.
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
        """runtime_dir was made again: lock the new file, or a daemon started now would find it free."""
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
