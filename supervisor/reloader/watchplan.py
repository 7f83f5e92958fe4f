"""What to watch, and what each filesystem event means.

A watched path is followed the way HAProxy (the kernel) reads it: component by component,
through every symlink. Each symlink met on the way, and each name not there yet, is watched in
the directory that holds it: a swap of any of them (`ln -s v2 current.new && mv -T current.new
current`, a ConfigMap's `..data`) changes what the path reads, and re-plans the watches. The
file itself is watched in the directory it really lives in, for completed writes only: a
close after writing, or a rename into place. A file being written (IN_MODIFY, a create not yet
closed) is not a change. `classify` is the pure rule; `plan_watches` reads only directory
entries and links.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .inotify import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    IN_UNMOUNT,
)

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
        mask = SELF_EVENTS
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
    """Walk `path` as the kernel resolves it, adding to `plan` every symlink met (in the directory
    holding it) and the first missing name; returns the real path it reads, or None when it
    does not resolve (missing, a loop, not a directory on the way)."""
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
    """The directories to watch for `files` (the rendered config, watched files) and
    `directories` (haproxy.watch entries that are directories, with what is under them)."""
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
            kept = []
            for sub in dirnames:
                if here / sub in ignored:
                    interest.ignore.add(sub)
                else:
                    kept.append(sub)
            dirnames[:] = kept
    return plan


def classify(interest: Interest | None, mask: int, name: str, is_link: bool = False) -> Meaning:
    """What one event means. `interest` is None for a watch no longer planned (its IN_IGNORED
    after a re-plan). `is_link`: the entry created is a symlink (asked only for IN_CREATE)."""
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
