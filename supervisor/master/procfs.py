"""What /proc says about a process: whether it lives, when it started, which sockets it holds."""

from __future__ import annotations

import contextlib
import os
from datetime import UTC, datetime

import psutil


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds (its /proc/<pid>/fd links `socket:[N]`)."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError), os.scandir(f"/proc/{pid}/fd") as fds:
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def process_started_at(pid: int) -> datetime | None:
    """When a process started (wall clock), or None if it is gone or hidden."""
    try:
        return datetime.fromtimestamp(psutil.Process(pid).create_time(), UTC)
    except psutil.Error:
        return None
