"""The ingress controller's runtime socket under many callers at once, straight to HAProxy and
through the daemon's relay, on each HAProxy binary.

    python -m bench.controller_relay [--callers 200 1000] [--steps 300] [--binary PATH ...]

The daemon runs in controller-socket mode (rigs/sidecar.py: 4 slots, 2 live pods,
HAProxy's stats socket at its default maxconn). Two measurements per binary and path
(*direct*: HAProxy's own stats socket; *relay*: the daemon's socket in front of it):

- *callers*: N callers connect at once, one line each, half of them the controller's disable
  (address, then maint; the relay reorders it into three connections) of a server HAProxy
  does not have, half `show info`. *Lost*: lines that got no answer from HAProxy (the
  connection failed, or the relay answered `[3]: haproxy-supervisor: ...` in its place).
  The latency is a caller's, from its connect to the end of the answer.
- *rolling*: the controller's rolling deployment over the slots (a new pod enabled and an old
  one disabled on each line) replayed line after line under keep-alive load, while waves of
  N callers at once (the same lines as above) run on the same socket until it is done.
  Reported: its non-200 responses, the lines lost of the waves, and the rolling lines'
  own latency. Straight to HAProxy the controller's address-first disable shows its 503 `SC`
  window; that is the control the relay's 0 is read against.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._doc import markdown_table  # noqa: E402
from bench.rolling import default_binaries, version_of  # noqa: E402
from rigs.controller import disable, sync_line, wrap  # noqa: E402
from rigs.harness import short_tmpdir  # noqa: E402
from rigs.sidecar import (  # noqa: E402
    Callers,
    Sidecar,
    controller_accepts,
    raise_fd_limit,
    rolling_lines,
    roundtrip,
    sidecar,
    simultaneous,
    under_load,
)

CALLERS = (200, 1000)
STEPS = 300


def caller_lines(count: int) -> list[bytes]:
    reordered = sync_line(disable("b", "NOPE", port=1))
    return [reordered if i % 2 == 0 else wrap(b"show info") for i in range(count)]


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def figures(latencies_ms: list[float]) -> tuple[str, str]:
    if not latencies_ms:
        return "", ""
    return f"{statistics.median(latencies_ms):.1f}", f"{percentile(latencies_ms, 0.99):.1f}"


async def rolling_under_callers(s: Sidecar, path: Path, steps: int, callers: int) -> dict[str, object]:
    lines = rolling_lines(s, steps)
    latencies: list[float] = []
    rolling_lost = 0
    waves: list[Callers] = []
    done = asyncio.Event()

    async def work() -> None:
        async def replay() -> None:
            nonlocal rolling_lost
            try:
                for line in lines:
                    began = time.monotonic()
                    try:
                        answer = await roundtrip(path, line)
                    except (OSError, TimeoutError):
                        rolling_lost += 1
                    else:
                        rolling_lost += b"haproxy-supervisor" in answer or not controller_accepts(answer)
                        latencies.append((time.monotonic() - began) * 1000)
                    await asyncio.sleep(0.002)
            finally:
                done.set()

        async def hammer() -> None:
            while not done.is_set():
                waves.append(await simultaneous(path, caller_lines(callers)))

        await asyncio.gather(replay(), hammer())

    load = await under_load(s.front, work)
    await asyncio.sleep(0.1)
    non_200 = sum(count for status, count in load.statuses.items() if status != 200)
    return {
        "requests": load.requests, "non_200": non_200, "failed_log": len(s.failed_lines()),
        "waves": len(waves), "lost": sum(w.lost for w in waves) + rolling_lost,
        "sent": sum(len(w.answers) for w in waves) + len(lines), "rolling_lost": rolling_lost,
        "latencies": latencies,
    }


async def measure(binary: str, callers: tuple[int, ...], steps: int) -> list[tuple[object, ...]]:
    os.environ["HAPROXY_BIN"] = binary
    version = version_of(binary)
    rows: list[tuple[object, ...]] = []
    directory = short_tmpdir("hs-bench-")
    try:
        async with sidecar(directory) as s:
            for count in callers:
                for name, path, retrying in (("direct", s.stats_socket, False),
                                             ("direct, callers retry EAGAIN", s.stats_socket, True),
                                             ("relay", s.runtime_socket, False)):
                    result = await simultaneous(path, caller_lines(count), retrying=retrying)
                    rows.append((version, f"{count} callers", name, f"{result.lost} of {count}",
                                 *figures(result.latencies_ms), ""))
                    print(f"  {version} {count} callers {name}: lost {result.lost} {dict(result.errors)}", flush=True)
            for name, path in (("direct", s.stats_socket), ("relay", s.runtime_socket)):
                r = await rolling_under_callers(s, path, steps, max(callers))
                rows.append((version, f"rolling {steps} lines + waves of {max(callers)}", name,
                             f"{r['lost']} of {r['sent']}", *figures(r["latencies"]),  # type: ignore[arg-type]
                             f"{r['non_200']} of {r['requests']}"))
                print(f"  {version} rolling {name}: {r}"[:300], flush=True)
            log = s.daemon.run_log()
        invalid = log.count("Invalid argument")
        if invalid:
            print(f"  {version}: {invalid} 'Invalid argument' in the daemon's log", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


HEADER = ("haproxy", "run", "path", "lines lost", "line median ms", "line p99 ms", "non-200")


def run(binaries: list[str], callers: tuple[int, ...], steps: int) -> str:
    # Every caller holds a descriptor, the relay two per line in flight; the daemon inherits it.
    raise_fd_limit(8 * max(callers) + 1024)
    rows: list[tuple[object, ...]] = []
    for binary in binaries:
        rows += asyncio.run(measure(binary, callers, steps))
    return markdown_table(HEADER, rows)


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: each binary (the first only, 20 and 50 callers, when quick)."""
    if quick:
        return run(default_binaries()[:1], (20, 50), 20)
    return run(default_binaries(), CALLERS, STEPS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, nargs="+", default=list(CALLERS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--binary", action="append", help="an HAProxy binary (repeatable)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        print(run(args.binary or default_binaries(), tuple(args.callers), args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
