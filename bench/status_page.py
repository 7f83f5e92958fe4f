"""How long the status page takes to build at fleet size.

The state of a daemon after a big drain (rigs/status_state.fleet_state): 10,000
servers in 1,000 backends, 1,000 of them dead in 710 backends, 50 old workers each steered
away from all 1,000, and an hour of chart history. Median and p90 of 30 runs, milliseconds:

    document     status_document(): the /status JSON as a dict, which the page is built from
    page         the HTML from the document (dead servers grouped by backend, charts, tables),
                 with the servers per backend already counted (what every refresh pays)
    page, cold   the same right after a reload: the new config's servers per backend counted
                 and the steered servers' backends worked out again
    GET /        the whole answer over HTTP on 127.0.0.1, through the status app

    python -m bench status_page
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime

import aiohttp

from bench._doc import markdown_table
from rigs.harness import free_port
from rigs.status_server import start_status_server
from rigs.status_state import RecordingActions, fleet_state
from supervisor.page import BackendSizes, backends_of, page_of
from supervisor.settings import Settings
from supervisor.status.document import status_document
from supervisor.status.routes import build_app

RUNS = 30


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * 0.9) - 1)]


def figures(name: str, values: list[float]) -> str:
    return f"{name:<14} median {statistics.median(values):7.1f} ms   p90 {p90(values):7.1f} ms   n={len(values)}"


def timed(action: Callable[[], object], runs: int, before: Callable[[], object] = lambda: None) -> list[float]:
    values = []
    for _ in range(runs):
        before()
        started = time.perf_counter()
        action()
        values.append((time.perf_counter() - started) * 1000)
    return values


async def over_http(state, runs: int) -> tuple[list[float], int]:
    port = free_port()
    runner = await start_status_server(build_app(state, Settings(), RecordingActions(state)), f"127.0.0.1:{port}")
    values, size = [], 0
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(runs):
                started = time.perf_counter()
                async with session.get(f"http://127.0.0.1:{port}/") as answer:
                    size = len(await answer.read())
                values.append((time.perf_counter() - started) * 1000)
    finally:
        await runner.cleanup()
    return values, size


def measure(runs: int = RUNS) -> tuple[str, list[tuple[str, list[float]]], int]:
    """The state's description, each row's label and samples (milliseconds), and the page's size."""
    now = datetime.now(UTC)
    state = fleet_state(now)
    settings = Settings()
    doc = status_document(state, settings, now)
    sizes = BackendSizes()
    page_of(state, doc, now, sizes)
    cold_sizes: list[BackendSizes] = []

    def forget() -> None:
        cold_sizes[:] = [BackendSizes()]
        backends_of.cache_clear()

    described = f"{len(state.dead_servers):,} dead of 10,000 servers, {len(state.old_workers)} old workers"
    rows = [
        ("document", timed(lambda: status_document(state, settings, now), runs)),
        ("page", timed(lambda: page_of(state, doc, now, sizes), runs)),
        ("page, cold", timed(lambda: page_of(state, doc, now, cold_sizes[0]), runs, forget)),
    ]
    values, size = asyncio.run(over_http(state, runs))
    return described, [*rows, ("GET /", values)], size


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: 30 runs (3 when quick)."""
    described, rows, size = measure(3 if quick else RUNS)
    labels = {
        "document": "the /status document",
        "page": "the page from it",
        "page, cold": "the page right after a reload",
        "GET /": f"`GET /` over HTTP ({size / 1024:.0f} KiB)",
    }
    return markdown_table(
        [described, "median ms", "p90 ms", "runs"],
        [(labels[name], f"{statistics.median(v):.1f}", f"{p90(v):.1f}", len(v)) for name, v in rows],
    )


def main() -> None:
    described, rows, size = measure()
    print(described)
    for name, values in rows:
        print(figures(name, values) + (f"   {size / 1024:.0f} KiB" if name == "GET /" else ""))


if __name__ == "__main__":
    main()
