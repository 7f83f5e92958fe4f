"""Living on the daemon's one event loop: every task waits while some callback holds it. The cyclic
collector is kept out of reloads (docs/architecture.md): a full collection walks every live
generation's models, so what lives is frozen after each reload (the models are acyclic)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import time
from collections.abc import Callable, Generator, Iterator
from typing import TypeVar

from .state import State

_T = TypeVar("_T")


async def wait_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until `event` is set or `timeout` seconds pass; True if it was set. On Python 3.11
    `asyncio.wait_for` loses a cancel that arrives as the awaited thing completes."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


def next_tick(now: float, interval_ms: int) -> float:
    """The first grid instant after `now` (loop time, s): timers whose intervals divide each other
    fall due in one wake. A microsecond of slack: at a grid instant `now * 1000` can come out a hair under."""
    return ((int(now * 1000 + 1e-3)) // interval_ms + 1) * interval_ms / 1000


GRID_MS = 100  # the lag gauge's interval: every periodic timer falls due on its instants


def on_grid(delay_s: float) -> float:
    """`delay_s` stretched to the next instant of the shared grid (at most GRID_MS more): a
    periodic task that sleeps so wakes the loop together with the others, not in a turn of its
    own. A delay shorter than the grid (a fast poll) is kept as it is."""
    if delay_s < GRID_MS / 1000:
        return delay_s
    now = asyncio.get_running_loop().time()
    return next_tick(now + delay_s, GRID_MS) - now


def finished(steps: Generator[None, None, _T]) -> _T:
    """Run a generator of slices to its end at once; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


async def sliced(steps: Generator[None, None, _T]) -> _T:
    """Run a generator of slices, the event loop let run between them; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


class LoopLag:
    """How late the loop runs a timer: the worst of this WINDOW_S and the last, sampled on next_tick()'s grid."""

    INTERVAL_MS = GRID_MS
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
        """Sample until cancelled, each sample one timer callback that sets the next (a task would be two)."""
        loop = asyncio.get_running_loop()

        def sample(due: float) -> None:
            nonlocal handle
            self.note(max(0.0, loop.time() - due), time.monotonic())
            following = next_tick(loop.time(), self.INTERVAL_MS)
            handle = loop.call_at(following, sample, following)

        first = next_tick(loop.time(), self.INTERVAL_MS)
        handle = loop.call_at(first, sample, first)
        try:
            await loop.create_future()
        finally:
            handle.cancel()


def settle_after_reload() -> None:
    """Collect the young garbage, freeze what is alive, give back the reload's free heap pages."""
    gc.collect(1)
    gc.freeze()
    give_back_free_heap()


def give_back_free_heap() -> None:
    """After a burst of big transient objects (a config's copies, a 100,000-row CLI answer)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


# glibc keeps freed pages in its heap, the resident size at a reload's peak; musl has no malloc_trim.
_malloc_trim: Callable[[int], int] | None
try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim
except (OSError, AttributeError):
    _malloc_trim = None


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside (a reload cycle, bounded by reload.timeout_s); left as found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
