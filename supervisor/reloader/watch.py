"""Watching the inputs: the watches (inotify, kept in step with `watchplan`), the safety net
under them (`ContentCheck`), and the digest of the watched files."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..files import read_regular
from .inotify import IN_CREATE, Event, Inotify
from .watchplan import WatchPlan, classify, plan_watches

log = logging.getLogger(__package__)


def split_watch(config: Path, watch: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(files, directories) among what to watch; a path that does not exist yet counts as a file."""
    files = [config]
    dirs: list[Path] = []
    for p in watch:
        (dirs if p.is_dir() else files).append(p)
    return files, dirs


def inputs_digest(paths: Sequence[Path]) -> str:
    """sha256 over the content of every file under haproxy.watch: maps, certificates, includes.

    A change there needs a reload even when the effective config text is the same.
    Kubernetes' `..` internals are skipped: the visible names resolve through them.
    """
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
    """The watches of one plan, kept in step with it: each event either means nothing, a change
    (`changed()`), or that a path may read elsewhere now (re-plan, then a change)."""

    def __init__(self, files: Sequence[Path], directories: Sequence[Path], ignore: Sequence[Path],
                 changed: Callable[[], None], writing: Callable[[], None]) -> None:
        self.files, self.directories, self.ignore = list(files), list(directories), list(ignore)
        self.changed = changed
        self.writing = writing
        self.notify = Inotify()
        self.plan = WatchPlan()
        self._by_wd: dict[int, Path] = {}
        self._reported_missing: list[Path] = []

    def replan(self) -> None:
        """Watch what the paths lead to now. New watches go on before old ones come off, so no
        event falls between them."""
        plan = plan_watches(self.files, self.directories, self.ignore)
        by_wd: dict[int, Path] = {}
        for directory, interest in plan.directories.items():
            try:
                by_wd[self.notify.add(directory, interest.mask())] = directory
            except OSError as exc:  # gone since the walk: the event that removed it re-plans
                log.debug("watch: %s: %s", directory, exc.strerror or exc)
        for wd in set(self._by_wd) - set(by_wd):
            self.notify.remove(wd)
        self.plan, self._by_wd = plan, by_wd
        if plan.missing != self._reported_missing:
            if plan.missing:
                log.warning("watch: %s missing; watching for it to appear", ", ".join(map(str, plan.missing)))
            self._reported_missing = list(plan.missing)
        log.info("watching %s", ", ".join(f"{p} -> {r}" if p != r else str(p) for p, r in plan.resolved.items())
                 or "nothing yet")

    def events(self, events: list[Event]) -> None:
        replan = change = writing = False
        for event in events:
            directory = self._by_wd.get(event.wd)
            interest = None if directory is None else self.plan.directories.get(directory)
            is_link = bool(event.mask & IN_CREATE) and directory is not None and os.path.islink(
                directory / event.name
            )
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

    def close(self) -> None:
        self.notify.close()


async def watch_changes(files: Sequence[Path], directories: Sequence[Path], ignore: Sequence[Path],
                        changed: Callable[[], None], writing: Callable[[], None]) -> None:
    """Call `changed()` for each completed change to a watched path, and `writing()` while one
    is being written, for ever (inotify, read on the event loop). A path that does not resolve
    yet is waited for, and its appearing counts."""
    try:
        watch = FileWatch(files, directories, ignore, changed, writing)
    except OSError as exc:  # out of inotify instances (fs.inotify.max_user_instances)
        log.error("watch: no inotify (%s): only the look at the rendered config every second remains",
                  exc.strerror or exc)
        await asyncio.Event().wait()
        return
    try:
        watch.replan()
        watch.notify.start(watch.events)
        await asyncio.Event().wait()
    finally:
        watch.close()


def content_news(look: str | None, previous: str | None, read: str | None) -> bool:
    """Is what the safety net found news? Not when it is what it found last time, nor what the
    last cycle read (a change the watches reported, and a cycle loaded)."""
    return look != previous and look != read


class ContentCheck:
    """The safety net under the watches: the rendered config as HAProxy would read it (through
    every symlink), looked at every few seconds. A stat first; the content is hashed only when
    the stat changed."""

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

    def stale(self) -> bool:
        """Has the stat changed since the last look? Cheap: on the loop."""
        return self.stat_key() != self.key

    def look(self) -> tuple[tuple[int, ...] | None, str | None]:
        """(stat, sha256) now; off the loop, the file may be big."""
        key = self.stat_key()
        try:
            return key, hashlib.sha256(read_regular(self.path)).hexdigest()
        except OSError:
            return key, None

    def commit(self, key: tuple[int, ...] | None, sha: str | None) -> None:
        self.key, self.sha = key, sha
