"""Loaded into the daemon by `bench.daemon_idle` (its directory on PYTHONPATH).

When BENCH_CALLBACK_LOG names a file, every event-loop callback that holds the loop for more than
a millisecond is appended to it as `<monotonic start> <seconds held>`. The lag gauge samples the
loop every 100 ms, so it reads a stretch of L ms as anything between L - 100 and L; this log lets
the bench find the longest stretch of each phase exactly. CLOCK_MONOTONIC is the same clock in
every process, so the bench compares it with its own.

When BENCH_CALLBACK_CPU names a file, the thread CPU time of every callback is added up by its
owner (a task's coroutine, or the function called), and the totals are written to it as JSON at
most once a second, with the monotonic time they were taken: the bench reads what one part of
the daemon (the detector) costs at rest, apart from the noise of the rest of the machine.
"""

import os

if os.environ.get("BENCH_CALLBACK_LOG") or os.environ.get("BENCH_CALLBACK_CPU"):
    import asyncio
    import asyncio.events
    import json
    import time

    _log_path = os.environ.get("BENCH_CALLBACK_LOG")
    _log = open(_log_path, "a", buffering=1) if _log_path else None  # noqa: SIM115 - lives as long as the process
    _cpu_path = os.environ.get("BENCH_CALLBACK_CPU")
    _totals: dict[str, list[float]] = {}  # owner -> [callbacks, CPU seconds]
    _written = [0.0]
    _run = asyncio.events.Handle._run

    def _owner(callback: object) -> str:
        task = getattr(callback, "__self__", None)
        if isinstance(task, asyncio.Task):
            coro = task.get_coro()
            return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
        return getattr(callback, "__qualname__", type(callback).__name__)

    def _write_totals(now: float) -> None:
        _written[0] = now
        scratch = f"{_cpu_path}.tmp"
        with open(scratch, "w") as out:
            json.dump({"at": now, "totals": _totals}, out)
        os.replace(scratch, _cpu_path)

    def _timed_run(self: asyncio.events.Handle) -> None:
        started, cpu = time.monotonic(), time.thread_time()
        try:
            _run(self)
        finally:
            now = time.monotonic()
            if _cpu_path:
                entry = _totals.setdefault(_owner(self._callback), [0, 0.0])
                entry[0] += 1
                entry[1] += time.thread_time() - cpu
                if now - _written[0] >= 1.0:
                    _write_totals(now)
            if _log is not None and now - started > 0.001:
                _log.write(f"{started:.6f} {now - started:.6f}\n")

    asyncio.events.Handle._run = _timed_run
