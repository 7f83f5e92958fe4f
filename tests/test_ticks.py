"""Periodic timers on the shared grid (supervisor/eventloop.py): the detector's polls and the lag
gauge's samples fall due at the same instants, so at rest they cost one wake of the daemon."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine

import pytest

from supervisor.eventloop import GRID_MS, next_tick, on_grid


@pytest.mark.parametrize(("now", "interval_ms", "due"), [
    (0.0, 100, 0.1),
    (0.0999, 100, 0.1),
    (0.1, 100, 0.2),  # never the instant it is: a turn ends before the next one is due
    (12.3456, 100, 12.4),
    (12.3456, 50, 12.35),
    (12.3456, 250, 12.5),
])
def test_the_next_grid_instant(now: float, interval_ms: int, due: float):
    assert next_tick(now, interval_ms) == pytest.approx(due, abs=1e-9)


def test_grids_whose_intervals_divide_each_other_share_their_instants_exactly():
    # Exactly the same float, or the loop runs the two timers in separate wakes.
    for k in range(1, 20_000):
        now = 1000 + k * 0.0997
        due, fine = next_tick(now, 100), next_tick(now, 50)
        while fine < due:
            fine = next_tick(fine, 50)
        assert fine == due, now


def test_a_turn_at_a_grid_instant_is_followed_by_the_next_one():
    for k in range(1, 20_000):
        due = next_tick(k * 0.0997, 50)
        assert next_tick(due, 50) == pytest.approx(due + 0.05, abs=1e-9), due


class CountingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Counts the selects that waited: the times the process slept and was woken."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def select(self, timeout: float | None = None):  # type: ignore[no-untyped-def]
        if timeout is None or timeout > 0:
            self.waits += 1
        return super().select(timeout)


def wakes(timer_a, timer_b) -> int:  # type: ignore[no-untyped-def]
    """The wakes of a loop that runs two periodic timers ten turns each."""
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)

    async def both() -> None:
        await asyncio.gather(timer_a(), timer_b())

    try:
        loop.run_until_complete(both())
    finally:
        loop.close()
    return selector.waits


async def grid_ticks(interval_ms: int = GRID_MS) -> None:
    """Ten ticks on next_tick()'s grid; at GRID_MS, the lag gauge's pace."""
    loop = asyncio.get_running_loop()
    for _ in range(10):
        await asyncio.sleep(next_tick(loop.time(), interval_ms) - loop.time())


def fine_grid_ticks() -> Coroutine[None, None, None]:
    return grid_ticks(50)


async def offset_sleeps() -> None:
    await asyncio.sleep(0.021)
    for _ in range(10):
        await asyncio.sleep(0.05)


async def sleeps() -> None:
    for _ in range(10):
        await asyncio.sleep(0.05)


def test_two_timers_on_the_grid_share_their_wakes():
    assert wakes(fine_grid_ticks, fine_grid_ticks) <= 12


def test_control_two_timers_that_sleep_their_interval_wake_apart():
    assert wakes(sleeps, offset_sleeps) >= 19


async def seconds_on_grid() -> None:
    """A slower periodic task (housekeeping, a probe) started off the grid, its sleeps stretched."""
    await asyncio.sleep(0.013)
    for _ in range(3):
        await asyncio.sleep(on_grid(0.25))


async def seconds_apart() -> None:
    await asyncio.sleep(0.013)
    for _ in range(3):
        await asyncio.sleep(0.25)


def test_a_slower_timer_stretched_to_the_grid_wakes_with_the_samples():
    assert wakes(grid_ticks, seconds_on_grid) <= 11


def test_control_a_slower_timer_that_sleeps_its_interval_wakes_on_its_own():
    assert wakes(grid_ticks, seconds_apart) >= 13


def test_on_grid_stretches_a_delay_by_less_than_the_grid_and_keeps_a_fast_poll():
    async def delays() -> list[tuple[float, float, float]]:
        loop = asyncio.get_running_loop()
        out = []
        for delay in (0.0, 0.02, 0.1, 0.25, 1.0, 5.0):
            now = loop.time()
            out.append((delay, on_grid(delay), now))
        return out

    for delay, stretched, now in asyncio.run(delays()):
        if delay < GRID_MS / 1000:
            assert stretched == delay
        else:
            assert delay <= stretched <= delay + GRID_MS / 1000 + 1e-6
            due = now + stretched
            assert abs(due * 1000 / GRID_MS - round(due * 1000 / GRID_MS)) < 1e-3, due
