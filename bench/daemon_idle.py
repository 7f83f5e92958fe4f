"""The real daemon at fleet size: idle CPU and memory, the operator API, the event loop's lag.

`haproxy-supervisor run` (a subprocess, default settings, the guard on, its status API on a
unix socket) supervises a rendered config of S servers in bench.displaced_push's shape
(backends of 10 primaries and a backup, no health checks) with W old workers alive, each
held by an idle connection. Then, one phase after another, each longer than the lag
gauge's window (so each reading covers that phase only):

    idle     the daemon's CPU over IDLE_S seconds, as a share of one core, its RSS, and
             how often its event loop's thread went to sleep (its voluntary context
             switches: one per wait of the loop that found nothing ready)
    POST     POST then DELETE /servers/<b>/<s>/dead for N servers that exist, one after
             another (each wakes a push round to every old worker), and for a server
             that does not exist (404): latency, median and worst
    lag      haproxy_supervisor_event_loop_lag_seconds (worst delay of the event loop)
             scraped after the idle phase, after the POSTs and their push rounds, and
             after a reload that drains 1% of the servers, once every old worker is
             steered
    held     the longest event-loop callback of each of those phases, exactly: the daemon
             runs with bench/callbacks/sitecustomize.py, which logs every callback that
             holds the loop over 1 ms (the gauge samples every 100 ms and can read a
             stretch as up to 100 ms shorter than it was)

With --checks every server is health checked (`check inter 2s`) and the bench listens on every
server's address, so the checks pass and the servers stay UP: the daemon then hears HAProxy's
state lines instead of polling, and reads the current worker's states only as a safety net.
The figures add the full state reads over the idle phase.

With --failing-checks every server is health checked and nothing listens: in each new current
worker every check fails, the whole fleet of servers goes DOWN at once (a Ray cluster torn
down under the proxy), and the daemon pushes that to every old worker. The figures add the
daemon's CPU in the MASS_DOWN_S seconds right after the last reload, and the dead servers it
counts at their end.

    python -m bench.daemon_idle                          # 16 old workers, 10,000 servers
    python -m bench.daemon_idle --workers 5 --servers 1000
    python -m bench.daemon_idle --checks                 # the same, every server checked
    python -m bench.daemon_idle --failing-checks         # every check failing: the mass DOWN
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import resource
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench._doc import markdown_table
from bench._fleet import drained, rendered, runtime_tmpdir, server_name
from rigs.daemon import Daemon
from rigs.harness import free_port

IDLE_S = 30.0
SETTLE_S = 22.0  # longer than the lag gauge's window (10 to 20 s)
MASS_DOWN_S = 30.0


async def request(sock: Path, method: str, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_unix_connection(str(sock))
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        writer.write(head.encode())
        await writer.drain()
        raw = (await asyncio.wait_for(reader.read(), 30)).decode(errors="replace")
    finally:
        writer.close()
    return int(raw.split(" ", 2)[1]), raw.partition("\r\n\r\n")[2]


async def metric(sock: Path, name: str) -> float:
    """A gauge's value; NaN where the daemon has no such metric (a version before it)."""
    _, body = await request(sock, "GET", "/metrics")
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.2)


CHECK = " check inter 2s"
_SERVER_LINE = re.compile(r"^(    server \S+ (\S+):(\d+)(?: backup)?)$", re.M)


def with_checks(text: str) -> str:
    return _SERVER_LINE.sub(lambda m: m[1] + CHECK, text)


def listen_on_servers(text: str) -> list[socket.socket]:
    """A listening socket at every server address of `text`, never accepted: a check's connect
    completes in the kernel's accept queue (deep enough for the bench's length)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = len(_SERVER_LINE.findall(text)) + 1024
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    listeners = []
    for address in sorted({(m[2], int(m[3])) for m in _SERVER_LINE.finditer(text)}):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(4096)
        listeners.append(sock)
    return listeners


def callback_totals(path: Path) -> tuple[float, dict[str, list[float]]]:
    """(when, owner -> [callbacks, CPU seconds]) as the daemon last wrote them
    (bench/callbacks/sitecustomize.py, at most once a second)."""
    found = json.loads(path.read_text())
    return found["at"], found["totals"]


def at_rest_by_owner(before: tuple[float, dict[str, list[float]]], after: tuple[float, dict[str, list[float]]]
                     ) -> dict[str, tuple[float, float]]:
    """Per owner, between two readings: (callbacks a second, CPU as a share of one core in %)."""
    elapsed = after[0] - before[0]
    return {
        owner: ((count - before[1].get(owner, [0, 0.0])[0]) / elapsed,
                100 * (cpu - before[1].get(owner, [0, 0.0])[1]) / elapsed)
        for owner, (count, cpu) in after[1].items()
    }


def wakes_at_rest(owners: dict[str, tuple[float, float]]) -> str:
    """One line per owner that ran at rest, the costliest first."""
    ranked = sorted(owners.items(), key=lambda item: -item[1][1])
    return "".join(f"    {owner}: {rate:.1f}/s, {pct:.3f} %\n" for owner, (rate, pct) in ranked if rate > 0)


def loop_sleeps(pid: int) -> int:
    """How many times the process's main thread, which runs the event loop, gave up the CPU
    to wait: /proc's count for that one thread, not the process's other threads."""
    for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise RuntimeError(f"no voluntary_ctxt_switches in /proc/{pid}/task/{pid}/status")


def longest_callback_ms(log: Path, start: float, end: float) -> float:
    """The longest event-loop callback that started between `start` and `end` (monotonic),
    from the daemon's callback log (bench/callbacks/sitecustomize.py)."""
    held = [0.0]
    with contextlib.suppress(FileNotFoundError):
        for line in log.read_text().splitlines():
            at, seconds = (float(x) for x in line.split())
            if start <= at <= end:
                held.append(seconds)
    return 1000 * max(held)


async def run(
    workers: int, servers: int, posts: int, checks: bool = False, detector: bool = True, failing: bool = False
) -> dict[str, Any]:
    directory = runtime_tmpdir("hsi-")
    callbacks = directory / "callbacks.log"
    cpu_totals = directory / "callbacks-cpu.json"
    front = free_port()
    base = rendered(servers, front, {})
    if checks or failing:
        base = with_checks(base)
    daemon = Daemon(directory, base, {
        "old_workers": {"guard": True}, "reload": {"timeout_s": 60}, "detector": {"enabled": detector},
    })
    sock = directory / "status.sock"
    holders: list[socket.socket] = listen_on_servers(base) if checks else []
    figures: dict[str, Any] = {}
    try:
        daemon.start(
            env={"BENCH_CALLBACK_LOG": str(callbacks), "BENCH_CALLBACK_CPU": str(cpu_totals),
                 "PYTHONPATH": str(Path(__file__).parent / "callbacks")}
        )
        await daemon.wait_generation(1, timeout=120)
        for i in range(workers):
            holders.append(socket.create_connection(("127.0.0.1", front)))
            await asyncio.sleep(0.05)  # accepted by the current worker before it is replaced
            daemon.write(base.replace("maxconn 2000", f"maxconn {2001 + i}"))
            await daemon.wait_generation(i + 2, timeout=120)
        if failing:
            process = psutil.Process(daemon.pid)
            cpu = process.cpu_times()
            await asyncio.sleep(MASS_DOWN_S)
            after = process.cpu_times()
            figures["mass_down_cpu_s"] = after.user + after.system - cpu.user - cpu.system
            figures["mass_down_dead"] = await metric(sock, "haproxy_supervisor_dead_servers")

        async def all_old() -> bool:
            return await metric(sock, "haproxy_supervisor_old_workers") == workers

        await until(all_old, 120, "old workers listed")
        await asyncio.sleep(SETTLE_S)
        process = psutil.Process(daemon.pid)
        reads = await metric(sock, "haproxy_supervisor_server_state_reads_total")
        cpu, started, totals = process.cpu_times(), time.monotonic(), callback_totals(cpu_totals)
        sleeps = loop_sleeps(daemon.pid)
        await asyncio.sleep(IDLE_S)
        after, elapsed = process.cpu_times(), time.monotonic() - started
        figures["loop_sleeps_per_s"] = (loop_sleeps(daemon.pid) - sleeps) / elapsed
        owners = at_rest_by_owner(totals, callback_totals(cpu_totals))
        figures["detector_cpu_pct"] = sum(pct for owner, (_, pct) in owners.items() if "StalledDetector" in owner)
        figures["callbacks_cpu_pct"] = sum(pct for _, pct in owners.values())
        figures["wakes"] = owners
        figures["idle_reads"] = await metric(sock, "haproxy_supervisor_server_state_reads_total") - reads
        figures["idle_cpu_pct"] = 100 * (after.user + after.system - cpu.user - cpu.system) / elapsed
        figures["rss_mb"] = process.memory_info().rss / 2**20
        figures["lag_idle_ms"] = 1000 * await metric(sock, "haproxy_supervisor_event_loop_lag_seconds")
        figures["held_idle_ms"] = longest_callback_ms(callbacks, started, started + elapsed)

        await asyncio.sleep(SETTLE_S)
        post, delete = [], []
        marks_started = time.monotonic()
        for b in range(posts):
            path = f"/servers/app{b}/{server_name(b, 3, {})}/dead"
            for method, samples in (("POST", post), ("DELETE", delete)):
                t = time.perf_counter()
                status, _ = await request(sock, method, path)
                samples.append(time.perf_counter() - t)
                assert status == 200, (method, path, status)
        t = time.perf_counter()
        status, _ = await request(sock, "POST", "/servers/app0/no_such_server/dead")
        figures["post_unknown_ms"] = 1000 * (time.perf_counter() - t)
        assert status == 404, status
        await asyncio.sleep(2)  # the push rounds the marks woke
        figures["post_p50_ms"], figures["post_max_ms"] = 1000 * statistics.median(post), 1000 * max(post)
        figures["delete_p50_ms"], figures["delete_max_ms"] = 1000 * statistics.median(delete), 1000 * max(delete)
        figures["lag_post_ms"] = 1000 * await metric(sock, "haproxy_supervisor_event_loop_lag_seconds")
        figures["held_post_ms"] = longest_callback_ms(callbacks, marks_started, time.monotonic())

        await asyncio.sleep(SETTLE_S)
        moved = {server: 1 for server in drained(servers, 0)}
        drain = rendered(servers, front, moved).replace("maxconn 2000", f"maxconn {2001 + workers}")
        drain_started = time.monotonic()
        daemon.write(with_checks(drain) if checks or failing else drain)
        await daemon.wait_generation(workers + 2, timeout=120)

        async def steered() -> bool:
            _, body = await request(sock, "GET", "/status")
            old = json.loads(body)["old_workers"]
            # With every check failing, a worker that found every server DOWN itself before it became
            # old skips them all: it has nothing to be steered from.
            return len(old) == workers and all(w["push"]["state"] == "ok" and (w["steered"] or failing) for w in old)

        await until(steered, 60, "old workers steered after the drain")
        figures["lag_reload_ms"] = 1000 * await metric(sock, "haproxy_supervisor_event_loop_lag_seconds")
        figures["held_reload_ms"] = longest_callback_ms(callbacks, drain_started, time.monotonic())
    finally:
        for holder in holders:
            holder.close()
        daemon.cleanup()
        shutil.rmtree(directory, ignore_errors=True)
    return figures


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: 16 old workers of 10,000 servers, 20 marks (2 of 200, 3 when quick)."""
    workers, servers, posts = (2, 200, 3) if quick else (16, 10_000, 20)
    f = asyncio.run(run(workers, servers, posts))
    return markdown_table([f"{workers} old workers, {servers:,} servers", "figure"], [
        ("daemon CPU at rest", f"{f['idle_cpu_pct']:.2f} % of a core"),
        ("of it, the stalled-connection detector's own callbacks", f"{f['detector_cpu_pct']:.3f} % of a core"),
        (f"full state reads in {IDLE_S:.0f} s at rest", f"{f['idle_reads']:.0f}"),
        ("daemon RSS", f"{f['rss_mb']:.0f} MB"),
        ("the event loop's waits at rest", f"{f['loop_sleeps_per_s']:.1f} a second"),
        ("`POST` / `DELETE` a server, median", f"{f['post_p50_ms']:.1f} / {f['delete_p50_ms']:.1f} ms"),
        (f"`POST` / `DELETE` a server, worst of {posts}", f"{f['post_max_ms']:.1f} / {f['delete_max_ms']:.1f} ms"),
        ("`POST` a server no config has (404)", f"{f['post_unknown_ms']:.1f} ms"),
        ("longest callback at rest", f"{f['held_idle_ms']:.1f} ms"),
        ("longest callback, the marks and their push rounds", f"{f['held_post_ms']:.1f} ms"),
        ("longest callback, a drain's reload and push round", f"{f['held_reload_ms']:.1f} ms"),
        ("lag gauge: at rest / marks / reload",
         f"{f['lag_idle_ms']:.1f} / {f['lag_post_ms']:.1f} / {f['lag_reload_ms']:.1f} ms"),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.daemon_idle", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=16, help="old workers alive")
    parser.add_argument("--servers", type=int, default=10000, help="servers in the rendered config")
    parser.add_argument("--posts", type=int, default=20, help="servers marked dead and back, one after another")
    parser.add_argument("--checks", action="store_true", help="health checks on every server (all UP)")
    parser.add_argument("--failing-checks", action="store_true",
                        help="health checks on every server, none answered (all DOWN: the mass DOWN)")
    parser.add_argument("--detector", choices=("on", "off"), default="on",
                        help="the stalled-connection detector (detector.enabled), to compare its cost")
    args = parser.parse_args(argv or [])
    f = asyncio.run(run(args.workers, args.servers, args.posts, args.checks, args.detector == "on",
                        args.failing_checks))
    if args.failing_checks:
        print(f"mass DOWN: daemon CPU {f['mass_down_cpu_s']:.2f} s in the {MASS_DOWN_S:.0f} s after the last "
              f"reload, {f['mass_down_dead']:.0f} dead servers counted at its end", flush=True)
    print(
        f"daemon at rest: {args.workers} old workers, {args.servers} servers"
        f"{', every one health checked' if args.checks else ''}, detector {args.detector}\n"
        f"  idle CPU {f['idle_cpu_pct']:.2f} % of a core, RSS {f['rss_mb']:.0f} MB, "
        f"{f['idle_reads']:.0f} full state reads in {IDLE_S:.0f} s, "
        f"the event loop waited {f['loop_sleeps_per_s']:.1f} times a second\n"
        f"  of it in event-loop callbacks {f['callbacks_cpu_pct']:.3f} %, the detector's own "
        f"{f['detector_cpu_pct']:.3f} %; what runs at rest (callbacks a second, % of a core):\n"
        f"{wakes_at_rest(f['wakes'])}"
        f"  POST p50 {f['post_p50_ms']:.1f} ms max {f['post_max_ms']:.1f} ms; "
        f"DELETE p50 {f['delete_p50_ms']:.1f} ms max {f['delete_max_ms']:.1f} ms; "
        f"POST unknown server (404) {f['post_unknown_ms']:.1f} ms\n"
        f"  worst event-loop lag: idle {f['lag_idle_ms']:.1f} ms, POSTs and their pushes {f['lag_post_ms']:.1f} ms, "
        f"a drain's reload and push {f['lag_reload_ms']:.1f} ms\n"
        f"  longest event-loop callback: idle {f['held_idle_ms']:.1f} ms, POSTs and their pushes "
        f"{f['held_post_ms']:.1f} ms, a drain's reload and push {f['held_reload_ms']:.1f} ms",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main(sys.argv[1:]))
