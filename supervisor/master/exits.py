"""A process's end: waiting for it without a thread (pidfd), describing it, bringing it about."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess


def watch_exit(pid: int) -> asyncio.Future[None]:
    """A future of the running loop that is done once process `pid` has exited.

    A pidfd becomes readable when its process exits, whether or not it is our child: no
    thread, no polling. Done at once if the process is already gone.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        done.set_result(None)
        return done

    def exited() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, exited)
    return done


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exit status unknown: not our child"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def reap(child: subprocess.Popen[bytes] | None) -> str:
    """Collect an exited child's status and describe it (no status for a process not our child)."""
    if child is None:
        return describe_exit(None)
    try:
        code = child.wait(timeout=1)
    except subprocess.TimeoutExpired:
        code = None
    return describe_exit(code)


def send_signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def kill_group(pid: int) -> None:
    """SIGKILL the session `pid` leads: a master we just started, and its workers with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
