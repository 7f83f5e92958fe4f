"""Event-loop lag: how late the daemon's one event loop runs a timer.

Every task (pushes to old workers, the operator API, the watcher) waits while some callback
holds the loop, so the worst recent lag is the delay any of them may have suffered.
"""

from __future__ import annotations

import asyncio
import time

from .state import State
from .ticks import tick


class LoopLag:
    """Samples the loop every INTERVAL_MS, on the shared grid of timers (ticks.py: the detector's
    polls fall in the same wakes); State.event_loop_lag_s is the worst lag of the last WINDOW_S
    (the current window and the one before it)."""

    INTERVAL_MS = 100
    WINDOW_S = 10.0

    def __init__(self, state: State) -> None:
        self.state = state
        self._window_start = time.monotonic()
        self._worst_now = 0.0
        self._worst_before = 0.0

    def note(self, lag_s: float, now: float) -> None:
        if now - self._window_start >= self.WINDOW_S:
            self._worst_before = self._worst_now if now - self._window_start < 2 * self.WINDOW_S else 0.0
            self._worst_now, self._window_start = 0.0, now
        self._worst_now = max(self._worst_now, lag_s)
        self.state.publish_event_loop_lag(max(self._worst_now, self._worst_before))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = await tick(self.INTERVAL_MS)
            self.note(max(0.0, loop.time() - due), time.monotonic())
