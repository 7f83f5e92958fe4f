"""The 100,000-server profile: the real daemon at rest and a drain's push, at 4 old workers.

Issue #35's third size, beside 16 x 10,000 (bench.daemon_idle) and 50 x 10,000
(bench.displaced_push): both benches run once more at 4 old workers of 100,000 servers (checks
off, for the file-descriptor limit), each in a process of its own, and the figures are set
beside the issue's targets. It takes about five minutes on a 2-core machine.

    python -m bench.large_fleet                  # 4 x 100,000
    python -m bench.large_fleet --servers 20000  # a smaller profile, same figures
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench import daemon_idle, displaced_push
from bench._doc import markdown_table
from bench._fleet import percentile

WORKERS, SERVERS = 4, 100_000
ROUNDS, POSTS = 5, 5
QUICK = (2, 200, 2, 2)  # workers, servers, rounds, posts


def _idle(workers: int, servers: int, posts: int) -> dict[str, Any]:
    return asyncio.run(daemon_idle.run(workers, servers, posts))


def _in_a_process(function: Any, *args: Any) -> Any:
    # A fresh interpreter each: one bench's heap and gc state must not weigh on the other's.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def profile(workers: int, servers: int, rounds: int, posts: int) -> list[tuple[str, str, str]]:
    """(figure, measured, the issue's target) rows."""
    started = time.monotonic()
    idle = _in_a_process(_idle, workers, servers, posts)
    push: displaced_push.Figures = _in_a_process(displaced_push.one_line, workers, servers, rounds)
    minutes = (time.monotonic() - started) / 60

    def ms(samples: list[float], q: float) -> str:
        return f"{percentile(samples, q) * 1000:,.0f} ms"

    return [
        ("daemon CPU at rest", f"{idle['idle_cpu_pct']:.2f} % of a core", "under 1 %"),
        ("daemon RSS at rest", f"{idle['rss_mb']:.0f} MB", "under 300 MB"),
        ("a drain's to-steer, p50 / p99", f"{ms(push.to_steered, 0.5)} / {ms(push.to_steered, 0.99)}",
         "p99 under 1 s"),
        ("the effective build, p50", ms(push.build, 0.5), ""),
        ("`haproxy -c` beyond the steering's prepare, p50", ms(push.check, 0.5), ""),
        ("the reload, p50", ms(push.reload, 0.5), ""),
        ("event-loop lag through a reload, p99", ms(push.lag, 0.99), ""),
        ("longest callback, a drain's reload and push round", f"{idle['held_reload_ms']:,.0f} ms", ""),
        ("HAProxy workers' RSS after the push rounds", f"{push.rss_mb:.0f} MB", ""),
        ("the whole profile", f"{minutes:.1f} min", "under 10 min"),
    ]


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: 4 old workers of 100,000 servers (2 of 200 when quick)."""
    workers, servers, rounds, posts = QUICK if quick else (WORKERS, SERVERS, ROUNDS, POSTS)
    header = (f"{workers} old workers, {servers:,} servers", "measured", "target (issue #35)")
    return markdown_table(header, profile(workers, servers, rounds, posts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.large_fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=WORKERS, help="old workers alive")
    parser.add_argument("--servers", type=int, default=SERVERS, help="servers in the rendered config")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="drains measured")
    args = parser.parse_args(argv)
    print(markdown_table(("figure", "measured", "target (issue #35)"),
                         profile(args.workers, args.servers, args.rounds, POSTS)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
