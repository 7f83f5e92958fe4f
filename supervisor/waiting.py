"""Bounded waits that never swallow a cancellation.

On Python 3.11, `asyncio.wait_for` returns normally when the awaited thing completes in the
same loop iteration as the waiting task is cancelled: the cancel is lost. A loop that waits on
its wake-up event that way can then never be stopped (the daemon hangs on SIGTERM, a test on
its teardown). `asyncio.timeout` keeps the cancel, so every bounded wait goes through it.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until `event` is set or `timeout` seconds pass; True if it was set."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
