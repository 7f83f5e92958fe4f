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

from bench._doc import markdown_table
from rigs.daemon import RENDERED, daemons
from rigs.harness import backends, free_port, short_tmpdir

CHANGES = 20
DEBOUNCE_MS = 50


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(len(ordered) * 0.9) - 1] if len(ordered) >= 10 else ordered[-1]


def figures(name: str, values: list[float]) -> str:
    return (
        f"{name:<38} n={len(values):<3} median={statistics.median(values):7.1f} ms"
        f"  p90={p90(values):7.1f} ms  max={max(values):7.1f} ms"
    )


async def run(changes: int = CHANGES) -> dict[str, list[float]]:
    """Milliseconds: start and adopt (one sample each), observed and own (one per change)."""
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
            for n in range(2, changes + 2):
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

        return {"start": [start_ms], "observed": observed, "own": own, "adopt": [adopt_ms]}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: 20 changes (3 when quick)."""
    f = asyncio.run(run(3 if quick else CHANGES))

    def row(name: str, values: list[float]) -> tuple[object, ...]:
        if len(values) == 1:
            return (name, 1, f"{values[0]:.1f}", "", "")
        return (name, len(values), f"{statistics.median(values):.1f}", f"{p90(values):.1f}", f"{max(values):.1f}")

    return markdown_table(["measured", "n", "median ms", "p90 ms", "max ms"], [
        row("daemon start until the first worker serves (Python start-up included)", f["start"]),
        row(f"rendered config renamed into place until `reload ok` (debounce {DEBOUNCE_MS} ms)", f["observed"]),
        row("the reload's own `duration_ms` (validate, reload, confirm)", f["own"]),
        row("`kill -9`, then `run` until the master is adopted (Python start-up included)", f["adopt"]),
    ])


def main() -> None:
    f = asyncio.run(run())
    print(f"{'daemon start -> first worker serving':<38} {f['start'][0]:7.1f} ms (includes Python start-up)")
    print(figures(f"write -> reload ok (debounce {DEBOUNCE_MS} ms)", f["observed"]))
    print(figures("reload duration_ms (daemon's own)", f["own"]))
    print(f"{'kill -9, run -> master adopted':<38} {f['adopt'][0]:7.1f} ms (includes Python start-up)")


if __name__ == "__main__":
    main()
