"""bench.daemon_idle's reading of the daemon's callback totals (bench/callbacks/sitecustomize.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from bench.daemon_idle import at_rest_by_owner, loop_sleeps, wakes_at_rest


def test_the_cost_at_rest_is_what_each_owner_added_between_the_two_readings():
    before = (100.0, {"look": [10, 0.010], "task LoopLag.run": [10, 0.020]})
    after = (110.0, {"look": [110, 0.030], "task LoopLag.run": [10, 0.020], "new": [5, 0.001]})
    owners = at_rest_by_owner(before, after)
    assert owners["look"] == pytest.approx((10.0, 0.2))
    assert owners["task LoopLag.run"] == pytest.approx((0.0, 0.0))
    assert owners["new"] == pytest.approx((0.5, 0.01))
    assert wakes_at_rest(owners).splitlines() == ["    look: 10.0/s, 0.200 %", "    new: 0.5/s, 0.010 %"]


def test_loop_sleeps_counts_the_main_threads_waits_and_not_other_threads():
    pid = os.getpid()
    before = loop_sleeps(pid)
    for _ in range(5):
        time.sleep(0.002)
    slept = loop_sleeps(pid) - before
    assert slept >= 5

    def sleeper() -> None:
        for _ in range(50):
            time.sleep(0.002)

    before = loop_sleeps(pid)
    other = threading.Thread(target=sleeper)
    other.start()
    other.join()  # one wait of the main thread, however often the other one slept
    assert loop_sleeps(pid) - before < 20
