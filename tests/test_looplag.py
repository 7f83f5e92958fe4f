"""The event-loop lag the daemon exports: what it measures, how long a spike stays visible."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.eventloop import LoopLag
from supervisor.state import State
from supervisor.status.document import metrics_registry


def test_the_worst_lag_of_the_last_window_stays_until_a_whole_window_passed():
    state = State()
    lag = LoopLag(state)
    start = time.monotonic()
    lag.note(0.3, start + 1)
    lag.note(0.01, start + 2)
    assert state.event_loop_lag_s == 0.3
    lag.note(0.02, start + lag.WINDOW_S + 1)  # a new window: the spike is in the one before
    assert state.event_loop_lag_s == 0.3
    lag.note(0.02, start + 2 * lag.WINDOW_S + 1)  # two windows on: forgotten
    assert state.event_loop_lag_s == 0.02
    lag.note(0.01, start + 5 * lag.WINDOW_S)  # after a long silence nothing old is carried over
    assert state.event_loop_lag_s == 0.01


async def test_a_callback_that_holds_the_loop_shows_as_lag():
    state = State()
    task = asyncio.create_task(LoopLag(state).run())
    try:
        await asyncio.sleep(0.25)
        time.sleep(0.4)  # holds the loop: the monitor's timer, due within 0.1 s, runs 0.3 s late at least
        await asyncio.sleep(0.15)
        assert state.event_loop_lag_s >= 0.3 - 0.01
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task



async def test_a_cancelled_gauge_samples_no_more():
    state = State()
    task = asyncio.create_task(LoopLag(state).run())
    await asyncio.sleep(0.15)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    state.event_loop_lag_s = -1.0
    await asyncio.sleep(0.25)  # two ticks: a timer left behind would have published
    assert state.event_loop_lag_s == -1.0

def test_the_lag_is_a_gauge_in_metrics():
    state = State()
    state.event_loop_lag_s = 0.042
    text = generate_latest(metrics_registry(state)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families["haproxy_supervisor_event_loop_lag_seconds"]
    assert family.type == "gauge" and family.documentation
    assert family.samples[0].value == 0.042
