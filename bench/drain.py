"""The drain incident three ways in one run: plain reload, observe only, haproxy-supervisor.

The staging is the end-to-end test's (rigs/incident.py): a Ray Serve-shaped config
(apps `echo` with 1 replica and `highscale` with 2, both only on the node being drained;
`wide` with 1 of its 3 replicas there; a `fallback` backup in every backend), real HAProxy
in master-worker mode, real backends on 127.0.0.1. Clients hold keep-alive connections to
the worker of each of the W generations; the replicas move and HAProxy reloads; the drained
node vanishes (connects to it hang). Then R requests arrive on the connections the old
workers hold, one every SPACING ms without waiting for the answers (the apps in turn, the
old workers in turn), one request per connection: with `option idle-close-on-response` an
old worker closes a connection after its next answer.

The modes differ only in who reloads and what HAProxy runs:
    plain reload    the rendered config as is, `reload` on the master CLI
    observe only    the same with `observe layer4 error-limit N on-error mark-down` on every
                    checked server (Ray Serve's fix; the daemon injects it when its env gate
                    is set)
    supervisor      `haproxy-supervisor run` with its defaults (old-worker guard on, observe
                    off) watching the rendered config

Per mode: requests that failed (not a 200), slower than 0.5 s, the slowest, the time all of
them took together, and that time as a multiple of the supervisor's.

    python -m bench drain
    python -m bench.drain --connect-timeout 1 --error-limit 3 --requests 30 --old-workers 1

Two vanished-server variants (`--vanish`) run in a network namespace of their own (root, nft):
one of two servers of a Ray-shaped backend (`http-reuse always`, no `timeout server`, Ray's
check timings, `timeout connect 5s`, `retries 3`, `option redispatch 1`, and `retry-on
conn-failure empty-response response-timeout` unless `--retry-on` says other words: Ray's
own template has `conn-failure` alone) stays in the config
and its port is dropped by nftables: `blackhole` drops what goes to it, `partition` both ways
while its process lives. Requests on held connections (an old worker, which pooled
connections to both servers) and on new ones (the current worker), with the daemon's
stalled-connection detector off (today) and on. HAPROXY_BIN picks the HAProxy.

    python -m bench.drain --vanish blackhole --requests 20
    python -m bench.drain --vanish partition --requests 20
    python -m bench.drain --vanish partition --requests 20 --retry-on conn-failure   # Ray's words
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench._doc import markdown_table
from rigs.harness import KeepAliveClient, short_tmpdir
from rigs.incident import APPS, Shape, Supervise, daemon_supervised, plain_haproxy, staged_drain, with_observe
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings

SLOW_S = 0.5


@dataclass(frozen=True)
class Parameters:
    connect_timeout_s: float = 1.0
    retries: int = 3
    error_limit: int = 3
    requests: int = 30
    old_workers: int = 1
    spacing_ms: float = 100.0
    vanish: str | None = None  # "blackhole" or "partition": a vanished-server variant
    retry_on: str = "conn-failure empty-response response-timeout"  # the variants' `retry-on` words


@dataclass(frozen=True)
class Mode:
    name: str
    guard: bool
    supervise: Callable[[Parameters], Supervise]


MODES = (
    Mode("plain HAProxy reload", False, lambda p: plain_haproxy()),
    Mode("observe only (Ray Serve's fix)", False, lambda p: plain_haproxy(with_observe(p.error_limit))),
    Mode("haproxy-supervisor", True, lambda p: daemon_supervised),
)


@dataclass(frozen=True)
class Answer:
    app: str
    status: int
    seconds: float


@dataclass(frozen=True)
class Result:
    mode: str
    answers: list[Answer]

    @property
    def failed(self) -> int:
        return sum(a.status != 200 for a in self.answers)

    @property
    def slow(self) -> int:
        return sum(a.seconds > SLOW_S for a in self.answers)

    @property
    def worst(self) -> float:
        return max(a.seconds for a in self.answers)

    @property
    def total(self) -> float:
        return sum(a.seconds for a in self.answers)

    @property
    def median(self) -> float:
        return statistics.median(a.seconds for a in self.answers)


def spread(held: dict[tuple[int, str], list[KeepAliveClient]], count: int) -> list[tuple[str, KeepAliveClient]]:
    """`count` connections: the apps in turn, within each app the old workers in turn."""
    generations = sorted({g for g, _ in held})
    order = [
        (app, held[g, app][k])
        for k in range(max(len(clients) for clients in held.values()))
        for app in APPS
        for g in generations
        if k < len(held[g, app])
    ]
    return order[:count]


async def run_mode(mode: Mode, params: Parameters) -> Result:
    rundir = short_tmpdir("hs-drain-")
    try:
        settings = Settings(
            haproxy=HAProxySettings(runtime_dir=rundir / "run"), old_workers=OldWorkerSettings(guard=mode.guard),
        )
        shape = Shape(connect_timeout_s=params.connect_timeout_s, retries=params.retries)
        per_app = math.ceil(params.requests / (len(APPS) * params.old_workers))
        # Long enough for every connect attempt of a request to time out, then an answer.
        timeout = (params.retries + 1) * params.connect_timeout_s + 5
        async with staged_drain(settings, mode.supervise(params), params.old_workers, per_app, shape) as drain:
            chosen = spread(drain.held, params.requests)
            started = time.monotonic()
            jobs = []
            for i, (app, client) in enumerate(chosen):
                delay = started + i * params.spacing_ms / 1000 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                jobs.append(asyncio.create_task(client.get(f"/{app}", timeout=timeout)))
            answers = [
                Answer(app, status, seconds)
                for (app, _), (status, _, seconds) in zip(chosen, await asyncio.gather(*jobs), strict=True)
            ]
        return Result(mode.name, answers)
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


def format_seconds(value: float) -> str:
    return f"{value:.3f} s" if value < 0.1 else f"{value:.1f} s"


HEADER = ("mode", "failed", "slower than 0.5 s", "worst", "median", "all requests together", "x supervisor")


def rows(results: list[Result]) -> list[tuple[str, ...]]:
    """The table's rows; the last result is the supervisor, the basis of the ratio."""
    basis = results[-1].total
    return [
        (
            r.mode, f"{r.failed} / {len(r.answers)}", str(r.slow), format_seconds(r.worst), format_seconds(r.median),
            format_seconds(r.total), format_ratio(r.total / basis if basis > 0 else math.inf),
        )
        for r in results
    ]


def format_ratio(value: float) -> str:
    """Whole numbers from 10 up; below, two digits, so that a mode faster than the basis is not 0."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def table(results: list[Result]) -> str:
    """A Markdown table; the last result is the supervisor, the basis of the ratio."""
    return markdown_table(HEADER, rows(results))


# docs/benchmarks.md's configurations: the incident as staged, then three old workers alive at
# the drain with a shorter connect timeout.
SECTION = (Parameters(), Parameters(connect_timeout_s=0.5, old_workers=3))
QUICK = (Parameters(requests=6, spacing_ms=50),)


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: each configuration's three modes, one after the other."""
    found = []
    for params in QUICK if quick else SECTION:
        label = f"{params.old_workers}, {params.connect_timeout_s:g} s"
        found += [(label, *row) for row in rows(asyncio.run(run(params)))]
    return markdown_table(("old workers, timeout connect", *HEADER), found)


async def run(params: Parameters) -> list[Result]:
    return [await run_mode(mode, params) for mode in MODES]


def parse_args(argv: list[str] | None = None) -> Parameters:
    defaults = Parameters()
    parser = argparse.ArgumentParser(prog="python -m bench.drain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--connect-timeout", type=float, default=defaults.connect_timeout_s, metavar="SECONDS",
                        help="the rendered config's `timeout connect` (default %(default)s)")
    parser.add_argument("--retries", type=int, default=defaults.retries, help="`retries` (default %(default)s)")
    parser.add_argument("--error-limit", type=int, default=defaults.error_limit,
                        help="observe's error-limit in the observe-only mode (default %(default)s)")
    parser.add_argument("--requests", type=int, default=defaults.requests,
                        help="requests sent through old workers after the drain (default %(default)s)")
    parser.add_argument("--old-workers", type=int, default=defaults.old_workers,
                        help="old workers alive at the drain (default %(default)s)")
    parser.add_argument("--spacing-ms", type=float, default=defaults.spacing_ms,
                        help="time between two requests' arrivals (default %(default)s)")
    parser.add_argument("--vanish", choices=("blackhole", "partition"), default=None,
                        help="a vanished-server variant instead of the drain, in a network namespace")
    parser.add_argument("--retry-on", default=defaults.retry_on, metavar="WORDS",
                        help="the vanished variants' `retry-on` words (default %(default)s)")
    args = parser.parse_args(argv)
    for name in ("connect_timeout", "requests", "old_workers", "error_limit"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.retries < 0 or args.spacing_ms < 0:
        parser.error("--retries and --spacing-ms must not be negative")
    return Parameters(args.connect_timeout, args.retries, args.error_limit, args.requests, args.old_workers,
                      args.spacing_ms, args.vanish, args.retry_on)


VANISH_HEADER = ("variant", "detector", "held: failed / slow / worst", "new: failed / slow / worst")


def vanished(variant: str, requests: int, retry_on: str = Parameters.retry_on) -> list[tuple[str, ...]]:
    """One variant with the detector off, then on: a row each."""
    from rigs.netns import run_in_netns
    from rigs.vanish import run_staged

    found = []
    for detector in (False, True):
        outcome = run_in_netns(run_staged, detector=detector, partition=variant == "partition", requests=requests,
                               retry_on=retry_on, timeout=120 + requests)
        cells = []
        for mode in ("held", "new"):
            failed, slow, worst = outcome.figures(mode)
            cells.append(f"{failed} / {slow} / {format_seconds(worst)}")
        found.append((variant, "on" if detector else "off", *cells))
    return found


def main(argv: list[str] | None = None) -> None:
    params = parse_args(argv)
    if params.vanish is not None:
        print(f"{params.requests} requests on held and on new connections after a server's port was dropped "
              f"({params.vanish}), retry-on {params.retry_on}", flush=True)
        print(markdown_table(VANISH_HEADER, vanished(params.vanish, params.requests, params.retry_on)))
        return
    print(
        f"{params.requests} requests through {params.old_workers} old worker(s) after a node drained and vanished: "
        f"timeout connect {params.connect_timeout_s:g}s, retries {params.retries}, option redispatch, "
        f"observe error-limit {params.error_limit}, one request every {params.spacing_ms:g} ms",
        flush=True,
    )
    print(table(asyncio.run(run(params))))


if __name__ == "__main__":
    main()
