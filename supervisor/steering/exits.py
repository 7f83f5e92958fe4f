"""Noticing a worker's exit without asking the master: a pidfd per worker, read by the event
loop (it becomes readable when the process exits; Linux 5.3+). An old worker that drained
and left is then listed again at once, while at rest `show proc` is asked only now and then.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable


class WorkerExits:
    """Calls `exited()` when any watched process exits."""

    def __init__(self, exited: Callable[[], None]) -> None:
        self._exited = exited
        self._fds: dict[int, int] = {}

    def watch_only(self, pids: Iterable[int]) -> None:
        """Watch these processes, and no other."""
        wanted = set(pids)
        for pid in [pid for pid in self._fds if pid not in wanted]:
            self._forget(pid)
        for pid in wanted - self._fds.keys():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._exited()  # gone already
                continue
            except OSError:
                continue  # no pidfd here: the periodic listing notices it
            self._fds[pid] = fd
            asyncio.get_running_loop().add_reader(fd, self._readable, pid)

    def close(self) -> None:
        for pid in list(self._fds):
            self._forget(pid)

    def _readable(self, pid: int) -> None:
        self._forget(pid)
        self._exited()

    def _forget(self, pid: int) -> None:
        fd = self._fds.pop(pid)
        with contextlib.suppress(ValueError, RuntimeError):
            asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
