"""Living on the daemon's one event loop: every task (pushes to old workers, the operator API,
the watcher) waits while some callback holds it, so what holds it, and for how long, is one
subject.

- Bounded waits that never swallow a cancellation. On Python 3.11, `asyncio.wait_for`
  returns normally when the awaited thing completes in the same loop iteration as the
  waiting task is cancelled: the cancel is lost. A loop that waits on its wake-up event that
  way can then never be stopped (the daemon hangs on SIGTERM, a test on its teardown).
  `asyncio.timeout` keeps the cancel, so every bounded wait goes through it (`wait_set`).
- Periodic timers on one shared grid of the loop's clock. A timer that sleeps its interval
  from whenever its last turn ended drifts against every other one, so each wakes the
  process on its own. Timers whose turns fall on whole multiples of their interval, counted
  in milliseconds of the loop's clock, fall due at the very same instant as any other timer
  on the grid whose interval divides theirs: the loop runs them in one wake (`tick`).
- The lag gauge: how late the loop runs a timer, the worst recent delay any task may have
  suffered (`LoopLag`).
- Work in slices: a generator that yields between slices, run with the loop let in between
  (`sliced`) or at once (`finished`).
- When Python's cyclic garbage collector may run: not in the middle of a reload. The daemon
  keeps one parsed config per live generation: with 50 old workers of a 10,000-server config
  that is millions of objects, all long-lived. A full collection walks every one of them
  (hundreds of milliseconds), and it starts whenever enough new objects have survived,
  which is during a reload, the moment the next config is parsed. Freezing what is alive
  after each reload moves it out of the collector's rounds for good. Young collections
  still come every few hundred new containers, and building the next config, working out
  its steering and pushing it make hundreds of thousands, on the way to steering the old
  workers. So the collector is paused for the reload cycle (`collector_paused`), and
  settle_after_reload() collects after it. Nothing leaks by it: the config models, their
  digests and the per-worker state are acyclic (tests/test_gcpolicy.py), so reference
  counting frees a generation's objects the moment the daemon forgets it, frozen or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Generator, Iterator
from typing import TypeVar

from .state import State

_T = TypeVar("_T")


async def wait_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until `event` is set or `timeout` seconds pass; True if it was set."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


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
    """Samples the loop every INTERVAL_MS, on the shared grid of timers (tick(): the detector's
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


def settle_after_reload() -> None:
    """Collect the young garbage (cheap), then freeze everything still alive."""
    gc.collect(1)
    gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside (a reload cycle: bounded by reload.timeout_s); the
    collector is left as it was found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
