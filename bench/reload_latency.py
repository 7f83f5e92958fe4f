"""Reload latency of the daemon against the real HAProxy: write -> new worker serving.

Prints, for N config changes: the time from the rename-into-place of the rendered config
to the daemon logging `reload ok` (includes debounce_ms), the daemon's own duration_ms
(validate + reload + confirm), and the time to adopt a running master after a kill -9.

    PATH=$PATH:/usr/sbin .venv/bin/python -m bench.reload_latency
"""

from __future__ import annotations

import asyncio
import re
import shutil
import statistics
import time

from tests.support.daemon import RENDERED, daemons
from tests.support.harness import backends, free_port, short_tmpdir

CHANGES = 20
DEBOUNCE_MS = 50


def figures(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[int(len(ordered) * 0.9) - 1] if len(ordered) >= 10 else ordered[-1]
    return (
        f"{name:<38} n={len(values):<3} median={statistics.median(values):7.1f} ms"
        f"  p90={p90:7.1f} ms  max={max(values):7.1f} ms"
    )


async def run() -> None:
    directory = short_tmpdir("hs-bench-")
    try:
        with daemons(directory) as make, backends("b1") as started:
            front = free_port()
            b1 = started["b1"].address
            d = make(
                RENDERED.format(front=front, backend=b1, tag="g1"),
                {"reload": {"debounce_ms": DEBOUNCE_MS, "min_interval_ms": 0}},
            )
            began = time.monotonic()
            d.start()
            await d.wait_generation(1)
            start_ms = (time.monotonic() - began) * 1000

            observed: list[float] = []
            for n in range(2, CHANGES + 2):
                t0 = time.monotonic()
                d.write(RENDERED.format(front=front, backend=b1, tag=f"g{n}"))
                await d.wait_log(rf"reload ok generation={n} ", timeout=30)
                observed.append((time.monotonic() - t0) * 1000)
            own = [float(m) for m in re.findall(r"reload ok .* duration_ms=(\d+)", d.run_log())]

            d.kill9()
            t0 = time.monotonic()
            d.start()
            await d.wait_log(r"master adopted pid=")
            adopt_ms = (time.monotonic() - t0) * 1000

        print(f"{'daemon start -> first worker serving':<38} {start_ms:7.1f} ms (includes Python start-up)")
        print(figures(f"write -> reload ok (debounce {DEBOUNCE_MS} ms)", observed))
        print(figures("reload duration_ms (daemon's own)", own))
        print(f"{'kill -9, run -> master adopted':<38} {adopt_ms:7.1f} ms (includes Python start-up)")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    asyncio.run(run())


if __name__ == "__main__":
    main()
