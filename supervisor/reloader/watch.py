"""Watching the inputs with inotify, and the safety net under it (`ContentCheck`). A path is followed
through every symlink, each watched in its directory, so a swap of any (a ConfigMap's `..data`)
re-plans the watches. Only completed writes count (IN_CLOSE_WRITE, IN_MOVED_TO)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hashlib
import logging
import os
import stat
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..files import read_regular

log = logging.getLogger(__package__)

IN_MODIFY = 0x00000002
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

_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


@dataclass(frozen=True)
class Event:
    wd: int
    mask: int
    name: str  # "" for an event on the watched directory itself


def parse_events(data: bytes) -> list[Event]:
    """The events in one read of an inotify descriptor (names are NUL-padded)."""
    events = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        wd, mask, _, length = _HEADER.unpack_from(data, offset)  # the cookie, which pairs moves, is unused
        offset += _HEADER.size
        raw = data[offset : offset + length]
        offset += length
        events.append(Event(wd, mask, os.fsdecode(raw.split(b"\0", 1)[0])))
    return events


ENTRY_EVENTS = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
SELF_EVENTS = IN_DELETE_SELF | IN_MOVE_SELF
MAX_LINKS = 40  # the kernel's own limit on symlinks in one path (ELOOP past it)

# "writing": a watched file is being written; not converged, and nothing to read until it is closed.
Meaning = Literal["ignore", "writing", "change", "replan"]


@dataclass
class Interest:
    """What matters in one directory."""

    path_names: set[str] = field(default_factory=set)  # symlinks and missing directories along a path
    file_names: set[str] = field(default_factory=set)  # files whose content is watched
    every_file: bool = False  # a directory under haproxy.watch: every entry is content
    ignore: set[str] = field(default_factory=set)  # entries never to count (runtime_dir inside a watched one)

    def mask(self) -> int:
        mask = SELF_EVENTS | IN_ONLYDIR | IN_DONT_FOLLOW  # the directory itself, never through a symlink
        if self.path_names:
            mask |= ENTRY_EVENTS
        if self.file_names or self.every_file:
            mask |= IN_CLOSE_WRITE | IN_MODIFY | ENTRY_EVENTS
        return mask


@dataclass
class WatchPlan:
    directories: dict[Path, Interest] = field(default_factory=dict)
    missing: list[Path] = field(default_factory=list)  # directories a watched path waits for
    # What each watched path reads now (after every symlink), for the logs.
    resolved: dict[Path, Path] = field(default_factory=dict)

    def at(self, directory: Path) -> Interest:
        return self.directories.setdefault(directory, Interest())


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def follow(path: Path, plan: WatchPlan, as_file: bool) -> Path | None:
    """Walk `path` as the kernel resolves it, adding to `plan` every symlink met and the first missing
    name; the real path it reads, or None when it does not resolve."""
    current = Path("/")
    queue = _parts(os.path.abspath(path))
    links = 0
    while queue:
        name = queue.pop(0)
        if name == "..":
            current = current.parent
            continue
        candidate = current / name
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            if queue or not as_file:
                plan.at(current).path_names.add(name)
                plan.missing.append(candidate)
            else:
                plan.at(current).file_names.add(name)  # a file not there yet: its completed write counts
            return None
        except OSError:
            return None
        if stat.S_ISLNK(info.st_mode):
            plan.at(current).path_names.add(name)
            links += 1
            if links > MAX_LINKS:
                return None
            try:
                target = os.readlink(candidate)
            except OSError:
                return None
            if target.startswith("/"):
                current = Path("/")
            queue = _parts(target) + queue
            continue
        if not queue:
            if as_file or not stat.S_ISDIR(info.st_mode):
                plan.at(current).file_names.add(name)
            return candidate
        if not stat.S_ISDIR(info.st_mode):
            return None
        current = candidate
    return current


def plan_watches(files: Sequence[Path], directories: Sequence[Path], ignore: Iterable[Path] = ()) -> WatchPlan:
    """The directories to watch for `files`, and for `directories` with what is under them."""
    plan = WatchPlan()
    ignored = {Path(os.path.realpath(i)) for i in ignore}
    for f in files:
        real = follow(Path(f), plan, as_file=True)
        if real is not None:
            plan.resolved[Path(f)] = real
    for d in directories:
        real = follow(Path(d), plan, as_file=False)
        if real is None:
            continue
        plan.resolved[Path(d)] = real
        for dirpath, dirnames, _ in os.walk(real):  # symlinked subdirectories are entries, not walked
            here = Path(dirpath)
            interest = plan.at(here)
            interest.every_file = True
            interest.ignore.update(sub for sub in dirnames if here / sub in ignored)
            dirnames[:] = [sub for sub in dirnames if sub not in interest.ignore]
    return plan


def classify(interest: Interest | None, mask: int, name: str, is_link: bool = False) -> Meaning:
    """What one event means. `interest` is None for a watch no longer planned (its IN_IGNORED after a re-plan)."""
    if mask & IN_Q_OVERFLOW:
        return "replan"  # events were lost: look at everything again
    if interest is None:
        return "ignore"
    if mask & (IN_IGNORED | SELF_EVENTS | IN_UNMOUNT):
        return "replan"  # the directory itself went away or moved: the path reads elsewhere now
    if not name or name in interest.ignore:
        return "ignore"
    if name in interest.path_names and mask & ENTRY_EVENTS:
        return "replan"
    if name in interest.file_names or interest.every_file:
        if mask & IN_ISDIR and mask & ENTRY_EVENTS:
            return "replan"  # a directory under a watched one: watch it too (or stop)
        if mask & IN_CREATE:
            # A regular file just created is being written: its close says when it is whole.
            # A symlink is whole at once, and it may lead somewhere new.
            return "replan" if is_link else "writing"
        if mask & (IN_CLOSE_WRITE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM):
            return "change"
        if mask & IN_MODIFY:
            return "writing"
    return "ignore"


def split_watch(config: Path, watch: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(files, directories) among what to watch; a path that does not exist yet counts as a file."""
    files = [config]
    dirs: list[Path] = []
    for p in watch:
        (dirs if p.is_dir() else files).append(p)
    return files, dirs


def inputs_digest(paths: Sequence[Path]) -> str:
    """sha256 over every file under haproxy.watch: a change there needs a reload even when the
    effective config is the same. Kubernetes' `..` internals are skipped: the names resolve through them."""
    h = hashlib.sha256()
    for root in sorted(paths):
        if root.is_dir():
            entries = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".."))
                entries.extend(Path(dirpath) / n for n in filenames if not n.startswith(".."))
            items = sorted(entries)
        else:
            items = [root]
        for item in items:
            h.update(str(item).encode() + b"\0")
            try:
                # A FIFO dropped into a watched directory must not block the loop: regular files only.
                h.update(hashlib.sha256(read_regular(item)).digest())
            except OSError:
                h.update(b"missing")
    return h.hexdigest()


class FileWatch:
    """The watches of one plan on one inotify descriptor (libc's), read on the event loop."""

    def __init__(self, files: Sequence[Path], directories: Sequence[Path], ignore: Sequence[Path],
                 changed: Callable[[], None], writing: Callable[[], None]) -> None:
        self.files, self.directories, self.ignore = list(files), list(directories), list(ignore)
        self.changed = changed
        self.writing = writing
        self._lib = libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.fd: int = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.plan = WatchPlan()
        self._by_wd: dict[int, Path] = {}
        self._reported_missing: list[Path] = []

    def replan(self) -> None:
        """Watch what the paths lead to now; new watches go on first, so no event falls between."""
        plan = plan_watches(self.files, self.directories, self.ignore)
        by_wd: dict[int, Path] = {}
        for directory, interest in plan.directories.items():
            wd = self._lib.inotify_add_watch(self.fd, os.fsencode(directory), interest.mask())
            if wd < 0:  # gone since the walk: the event that removed it re-plans
                log.debug("watch: %s: %s", directory, os.strerror(ctypes.get_errno()))
            else:
                by_wd[wd] = directory
        for wd in set(self._by_wd) - set(by_wd):
            self._lib.inotify_rm_watch(self.fd, wd)  # EINVAL for a watch the kernel dropped already
        self.plan, self._by_wd = plan, by_wd
        if plan.missing != self._reported_missing:
            if plan.missing:
                log.warning("watch: %s missing; watching for it to appear", ", ".join(map(str, plan.missing)))
            self._reported_missing = list(plan.missing)
        log.info("watching %s", ", ".join(f"{p} -> {r}" if p != r else str(p) for p, r in plan.resolved.items())
                 or "nothing yet")

    def readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        replan = change = writing = False
        for event in parse_events(data):
            directory = self._by_wd.get(event.wd)
            interest = None if directory is None else self.plan.directories.get(directory)
            is_link = bool(event.mask & IN_CREATE) and directory is not None and os.path.islink(directory / event.name)
            meaning = classify(interest, event.mask, event.name, is_link)
            if meaning not in ("ignore", "writing"):
                log.debug("watch: %s %s/%s (mask %#x)", meaning, directory, event.name, event.mask)
            replan |= meaning == "replan"
            change |= meaning in ("replan", "change")
            writing |= meaning == "writing"
        if replan:
            self.replan()
        if change:
            self.changed()
        elif writing:
            self.writing()


async def watch_changes(files: Sequence[Path], directories: Sequence[Path], ignore: Sequence[Path],
                        changed: Callable[[], None], writing: Callable[[], None]) -> None:
    """Call `changed()` for each completed change to a watched path, `writing()` while one is being written."""
    try:
        watch = FileWatch(files, directories, ignore, changed, writing)
    except OSError as exc:  # out of inotify instances (fs.inotify.max_user_instances)
        log.error("watch: no inotify (%s): only the look at the rendered config every second remains",
                  exc.strerror or exc)
        await asyncio.Event().wait()
        return
    loop = asyncio.get_running_loop()
    try:
        watch.replan()
        loop.add_reader(watch.fd, watch.readable)
        await asyncio.Event().wait()
    finally:
        loop.remove_reader(watch.fd)
        os.close(watch.fd)


def content_news(look: str | None, previous: str | None, read: str | None) -> bool:
    """News: neither what the safety net found last time nor what the last cycle read."""
    return look != previous and look != read


class ContentCheck:
    """The rendered config as HAProxy would read it, looked at every second; hashed when its stat changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.key: tuple[int, ...] | None = None
        self.sha: str | None = None

    def stat_key(self) -> tuple[int, ...] | None:
        try:
            info = os.stat(self.path)  # through every symlink, as HAProxy's open would
        except OSError:
            return None
        return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def look(self) -> tuple[tuple[int, ...] | None, str | None]:
        """(stat, sha256) now; off the loop, the file may be big."""
        key = self.stat_key()
        try:
            return key, hashlib.sha256(read_regular(self.path)).hexdigest()
        except OSError:
            return key, None

    def commit(self, key: tuple[int, ...] | None, sha: str | None) -> None:
        self.key, self.sha = key, sha
