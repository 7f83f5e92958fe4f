"""Loaded into the daemon by `bench.daemon_idle` (its directory on PYTHONPATH) when
BENCH_CALLBACK_LOG names a file: every event-loop callback that holds the loop for more than a
millisecond is appended to it as `<monotonic start> <seconds held>`.

The lag gauge samples the loop every 100 ms, so it reads a stretch of L ms as anything between
L - 100 and L; this log lets the bench find the longest stretch of each phase exactly.
CLOCK_MONOTONIC is the same clock in every process, so the bench compares it with its own.
"""

import os

if os.environ.get("BENCH_CALLBACK_LOG"):
    import asyncio.events
    import time

    _log = open(os.environ["BENCH_CALLBACK_LOG"], "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    _run = asyncio.events.Handle._run

    def _timed_run(self: asyncio.events.Handle) -> None:
        started = time.monotonic()
        try:
            _run(self)
        finally:
            held = time.monotonic() - started
            if held > 0.001:
                _log.write(f"{started:.6f} {held:.6f}\n")

    asyncio.events.Handle._run = _timed_run
