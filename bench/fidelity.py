"""Does a steered old worker route as HAProxy would? Issue #24's incident, three ways in one run.

The staging is the end-to-end test's (rigs/fidelity.py): one node dies and takes one
server of every backend with it, the new rendered config moves it and HAProxy reloads while
clients hold keep-alive connections in the old worker, then the same requests go to the old
worker. One backend per way HAProxy picks a server: cookie persistence (insert, rewrite,
prefix, a value from default-server), stick tables (stick on, stick match + store-request),
weights (10/90 and a dead 50; weight 0; a server the old worker sees DOWN), map-based hashing
(uri, hdr(), url_param), consistent hashing, leastconn, roundrobin, first and random.

    HAProxy alone     the rendered config as is, reloaded on the master CLI: the routing to
                      match (its own choice on live servers) and the black hole (the rest
                      waits `timeout connect 1s` on the dead server, then is redispatched)
    today's override  the supervisor's component with the guard reproducing nothing of
                      HAProxy's choice: every steered request drawn at random (the code
                      before #24)
    daemon            `haproxy-supervisor run` with its defaults

Per backend and mode, medians of the runs: persistence kept (answered requests whose cookie
or stick entry names a live server, and stay on it), weight shares over the live servers, hash keys
kept (answered keys whose server lives, on that server), and in every row the requests that failed
or took 0.5 s or more.

    python -m bench fidelity
    python -m bench.fidelity --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
from collections.abc import Callable, Iterator

import pytest

from bench._doc import markdown_table
from rigs.fidelity import BACKENDS, Figures, fidelity_disabled, staged
from rigs.harness import short_tmpdir
from rigs.incident import daemon_supervised, plain_haproxy
from rigs.supervised import supervised

MODES = ("HAProxy alone", "today's override", "daemon")
REQUESTS = 150


@contextlib.contextmanager
def todays_override() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    try:
        with fidelity_disabled(patch):
            yield
    finally:
        patch.undo()


def mode_setup(mode: str) -> tuple[bool, Callable, Callable[[], contextlib.AbstractContextManager]]:
    if mode == "HAProxy alone":
        return False, plain_haproxy(), contextlib.nullcontext
    if mode == "today's override":
        return True, supervised, todays_override
    return True, daemon_supervised, contextlib.nullcontext


async def one_run(mode: str, connections: int) -> dict[str, Figures]:
    guard, supervise, context = mode_setup(mode)
    rundir = short_tmpdir("hs-fid-")
    try:
        with context():
            async with staged(rundir, guard, connections=connections, supervise=supervise) as stage:
                backends = list(BACKENDS)
                figures = await asyncio.gather(*(stage.measure(b, REQUESTS) for b in backends))
                return dict(zip(backends, figures, strict=True))
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


def cell(runs: list[Figures]) -> str:
    kind = runs[0].kind
    bad = statistics.median(f.bad for f in runs)
    total = runs[0].total
    if kind in ("cookie", "stick", "hash"):
        value = f"{statistics.median(f.kept_pct for f in runs):.0f} %"
    else:
        servers = sorted({s for f in runs for s in f.shares} | set(runs[0].expected))
        value = " / ".join(f"{statistics.median(f.share_pct(s) for f in runs):.0f}" for s in servers)
    return f"{value} ({bad:.0f} of {total} bad)"


def what(backend: str) -> str:
    kind, lines, servers = BACKENDS[backend]
    if kind == "cookie":
        return f"`{lines[0]}`: cookie naming a live server kept"
    if kind == "stick":
        return f"`{lines[1]}`: stick entry on a live server kept"
    if kind == "hash":
        return f"`{' / '.join(lines)}`: keys on live servers kept"
    live = [(s, extra) for s, extra in servers if s not in ("gone", "down")]
    names = " / ".join(s for s, _ in live)
    if kind == "weights":
        weights = " / ".join(extra.split()[1] for _, extra in live)
        return f"`{lines[0]}`, weights {weights}: shares of {names} %"
    return f"`{lines[0]}`: shares of {names} %"


async def measure(runs: int, connections: int) -> dict[str, list[dict[str, Figures]]]:
    results: dict[str, list[dict[str, Figures]]] = {mode: [] for mode in MODES}
    for i in range(runs):
        for mode in MODES:
            results[mode].append(await one_run(mode, connections))
            print(f"  run {i + 1}: {mode} done", flush=True)
    return results


def table(results: dict[str, list[dict[str, Figures]]]) -> str:
    """The markdown table: a row per backend, a column per mode, and the bad requests of all."""
    rows = [
        (f"`{backend}`", what(backend), *(cell([r[backend] for r in results[mode]]) for mode in MODES))
        for backend in BACKENDS
    ]
    totals = []
    for mode in MODES:
        bad = statistics.median(sum(f.bad for f in r.values()) for r in results[mode])
        total = sum(f.total for f in results[mode][0].values())
        totals.append(f"{bad:.0f} of {total}")
    rows.append(("all", "requests failed or 0.5 s or more", *totals))
    return markdown_table(("backend", "what is measured", *MODES), rows)


RUNS = 3


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: one run, 12 held connections per backend (2 when quick); one run,
    not RUNS, keeps make bench's time."""
    return table(asyncio.run(measure(1, 2 if quick else 12)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--connections", type=int, default=12, help="held per backend")
    args = parser.parse_args()
    results = asyncio.run(measure(args.runs, args.connections))
    print(f"\nmedians of {args.runs} runs; `bad`: failed, or 0.5 s or more\n")
    print(table(results))


if __name__ == "__main__":
    main()
