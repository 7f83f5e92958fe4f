"""A loop that waits on its wake-up event stops when cancelled, even when the wake-up and the
cancel arrive in one loop iteration (the daemon's SIGTERM as a change or a server event comes
in). On Python 3.11, `asyncio.wait_for` drops such a cancel; the controls show it."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from rigs.daemon import RENDERED
from rigs.harness import backends, free_port
from rigs.supervised import supervised
from supervisor.eventloop import wait_set
from supervisor.haproxy.stderr import ServerEvent
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings

WaitSet = Callable[[asyncio.Event, float], Awaitable[object]]


async def _wait_for_set(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


async def _stops_when_woken_and_cancelled(wait: WaitSet) -> bool:
    """A poll loop like the daemon's, woken and cancelled at once: did the cancel stop it?"""
    event = asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while rounds < 100:
            rounds += 1
            await wait(event, 0.05)
            event.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)  # the loop is parked in its wait
    event.set()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return task.cancelled()


async def test_wait_set_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    event.set()
    assert await wait_set(event, 0.01) is True


async def test_wait_set_keeps_a_cancel_that_arrives_with_the_wake_up() -> None:
    assert await _stops_when_woken_and_cancelled(wait_set)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from Python 3.12 on")
async def test_control_wait_for_drops_the_cancel() -> None:
    assert not await _stops_when_woken_and_cancelled(_wait_for_set)


@pytest.mark.haproxy
async def test_old_workers_stop_when_cancelled_as_a_server_event_wakes_them(rundir: Path) -> None:
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir), old_workers=OldWorkerSettings(poll_interval_ms=50)
    )
    with backends("s1") as started:
        rendered = RENDERED.format(front=free_port(), tag="t", backend=f"127.0.0.1:{started['s1'].port}")
        async with supervised(settings, rendered) as sup:
            event = ServerEvent(sup.current_pid, "app", "s1", "DOWN")
            for _ in range(20):
                await asyncio.sleep(0.03)  # mostly parked in its wait between polls
                task = sup.task
                assert task is not None
                sup.displaced.on_server_event(event)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=5)
                assert task in done, "OldWorkers.run went on after its cancel"
                sup.start_displaced()
