"""Which filesystem events mean "the input changed", and the digest of the watched files."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from watchfiles import Change, awatch

from ..files import read_regular

log = logging.getLogger(__package__)
# watchfiles logs every batch at INFO; our own lines say what a change led to.
logging.getLogger("watchfiles").setLevel(logging.WARNING)


def _is_k8s_internal(relative: Path) -> bool:
    # Kubernetes' atomic writer keeps the real files in `..<timestamp>/` and swaps `..data`.
    return bool(relative.parts) and relative.parts[0].startswith("..")


class ChangeFilter:
    """Which filesystem events mean "the input changed".

    Watched files are seen through their parent directory, so a rename into place
    (editors, `mv`), a ConfigMap's `..data` symlink swap and a write through the file
    all count, while an editor's swap files and our own runtime_dir do not.
    """

    def __init__(self, files: Iterable[Path], directories: Iterable[Path], ignore: Iterable[Path] = ()) -> None:
        self.files = [Path(f) for f in files]
        self.targets = {f.resolve() for f in self.files} - set(self.files)
        self.directories = [Path(d) for d in directories]
        self.ignore = [Path(i) for i in ignore]

    def __call__(self, change: Change, path: str) -> bool:
        return self.relevant(Path(path))

    def relevant(self, p: Path) -> bool:
        if any(p == i or i in p.parents for i in self.ignore):
            return False
        for f in self.files:
            if p == f:
                return True
            if f.parent in p.parents and _is_k8s_internal(p.relative_to(f.parent)):
                return True
        if p in self.targets:
            return True
        return any(p == d or d in p.parents for d in self.directories)


def split_watch(config: Path, watch: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(files, directories) among what to watch; a path that does not exist yet counts as a file."""
    files = [config]
    dirs: list[Path] = []
    for p in watch:
        (dirs if p.is_dir() else files).append(p)
    return files, dirs


def watch_roots(files: Sequence[Path], directories: Sequence[Path]) -> list[Path]:
    """Directories to hand to inotify: each file's parent (and its symlink target's), each directory."""
    roots: set[Path] = set(directories)
    for f in files:
        roots.add(f.parent)
        target = f.resolve().parent
        if target != f.parent:
            roots.add(target)
    ordered = sorted(roots, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for root in ordered:
        if not any(k == root or k in root.parents for k in kept):
            kept.append(root)
    return kept


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


async def watch_changes(files: Sequence[Path], directories: Sequence[Path], change_filter: ChangeFilter,
                        changed: Callable[[], None]) -> None:
    """Call `changed()` for each relevant batch of events, for ever; a watched root that is
    missing is waited for, and its appearing counts as a change."""
    roots = watch_roots(files, directories)
    reported: list[Path] = []
    while True:
        existing = [r for r in roots if r.is_dir()]
        missing = [r for r in roots if not r.is_dir()]
        if missing != reported:
            if missing:
                log.warning("watch: %s missing; watching for it to appear", ", ".join(map(str, missing)))
            elif reported:
                # What appeared may hold the rendered config: look at it.
                changed()
            reported = missing
        if not existing:
            await asyncio.sleep(1)
            continue
        log.info("watching %s", ", ".join(map(str, existing)))
        # watchfiles' own batching is kept short: the debounce that matters is ours. With a root
        # missing, wake up every second to see whether it appeared.
        async for changes in awatch(
            *existing, watch_filter=change_filter, debounce=50, step=10,
            rust_timeout=1000 if missing else None, yield_on_timeout=bool(missing),
        ):
            if changes:
                log.debug("change: %s", ", ".join(sorted(p for _, p in changes)))
                changed()
            if missing and any(r.is_dir() for r in missing):
                break
