"""A Ray-shaped rolling deployment with and without servers added and removed at runtime.

    python -m bench.rolling [--backends 20] [--replicas 4] [--clients 8]

The real daemon (`python -m supervisor run`) watches a Ray Serve-shaped config: N backends
of R replicas, each server named after its replica, a `fallback` backup in each. Every
replica is replaced one by one by a new name on a new port, under steady keep-alive load
(clients cycling over the backends). The same deployment runs twice in one run: with
`reload.runtime_apply: true` (servers added and removed through the Runtime API) and with
`false` (every change a reload). Reported per run: reloads, old workers created, non-200
responses, the slowest request, and the time from the write of the rendered config to the
daemon saying the change is live (median and worst). The replicas are HTTP servers in this
process, one port each, on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.daemon import Daemon, daemons  # noqa: E402
from tests.support.harness import free_port, short_tmpdir  # noqa: E402
from tests.support.rolling import Load, ray_config  # noqa: E402


class Replicas:
    """HTTP/1.1 keep-alive servers in this process, one per port, answering with their name."""

    def __init__(self) -> None:
        self.servers: dict[str, asyncio.Server] = {}
        self.connections: set[asyncio.StreamWriter] = set()

    async def start(self, name: str) -> int:
        body = name.encode()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections.add(writer)
            with contextlib.suppress(Exception):
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
            self.connections.discard(writer)
            writer.close()

        port = free_port()
        self.servers[name] = await asyncio.start_server(serve, "127.0.0.1", port)
        return port

    def stop(self, name: str) -> None:
        self.servers.pop(name).close()

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


async def deployment(runtime_apply: bool, backends: int, replicas: int, clients: int) -> dict[str, float]:
    front = free_port()
    settings = {
        "reload": {"runtime_apply": runtime_apply},
        "old_workers": {"guard": True},
        "logging": {"level": "info"},
    }
    pool = Replicas()
    old_pids: set[int] = set()
    live_s: list[float] = []
    try:
        fallback = await pool.start("fallback")
        apps = {
            f"app{i:02d}": [(f"app{i:02d}_r{j}", await pool.start(f"app{i:02d}_r{j}")) for j in range(1, replicas + 1)]
            for i in range(1, backends + 1)
        }
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
        "reloads": len(re.findall(r"reload ok generation=", log)),
        "old_workers": len(old_pids),
        "requests": len(load.statuses),
        "non_200": load.non_200,
        "slowest_s": load.slowest_s,
        "live_median_s": statistics.median(live_s),
        "live_worst_s": max(live_s),
        "shutdowns": len(re.findall(r"shutting them down", log)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    print(f"{args.backends} backends x {args.replicas} replicas, each replaced by a new name on a new port, "
          f"{args.clients} keep-alive clients")
    print(f"{'mode':<22}{'changes':>8}{'reloads':>8}{'old wk':>8}{'requests':>10}{'non-200':>8}"
          f"{'slowest s':>10}{'live med s':>11}{'live max s':>11}{'shut down':>10}")
    for runtime_apply, mode in ((True, "runtime add/remove"), (False, "reload (runtime off)")):
        r = asyncio.run(deployment(runtime_apply, args.backends, args.replicas, args.clients))
        print(f"{mode:<22}{r['changes']:>8}{r['reloads']:>8}{r['old_workers']:>8}{r['requests']:>10}"
              f"{r['non_200']:>8}{r['slowest_s']:>10.3f}{r['live_median_s']:>11.3f}{r['live_worst_s']:>11.3f}"
              f"{r['shutdowns']:>10}",
              flush=True)


if __name__ == "__main__":
    main()
