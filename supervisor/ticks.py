"""Periodic timers on one shared grid of the event loop's clock.

A timer that sleeps its interval from whenever its last turn ended drifts against every other
one, so each wakes the process on its own. Timers whose turns fall on whole multiples of their
interval, counted in milliseconds of the loop's clock, fall due at the very same instant as any
other timer on the grid whose interval divides theirs: the loop runs them in one wake.
"""

from __future__ import annotations

import asyncio


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def next_tick(now: float, interval_ms: int) -> float:
    """The first grid instant after `now` (loop time, seconds) for a timer of `interval_ms`:
    the same float for every timer whose grid has it (an integer count of milliseconds / 1000).
    Called at a grid instant (a timer's turn), `now * 1000` can come out a hair under the whole
    millisecond it is: a microsecond of slack keeps it from answering that instant again."""
    return ((int(now * 1000 + 1e-3)) // interval_ms + 1) * interval_ms / 1000


async def tick(interval_ms: int) -> float:
    """Sleep until the next grid instant of `interval_ms`; that instant (loop time)."""
    loop = asyncio.get_running_loop()
    due = next_tick(loop.time(), interval_ms)
    future = loop.create_future()
    handle = loop.call_at(due, _wake, future)
    try:
        await future
    finally:
        handle.cancel()
    return due
