"""How fast every old worker is steered off a drained node, against the real HAProxy.

For W old workers (held alive by an idle connection each) and a rendered config of S
servers (backends of 10 primaries and a backup, no health checks, addresses on closed
loopback ports), each round drains one "node": 1% of the servers, one per backend, move
to new addresses in a new rendered config. Each pass over the backends drains another of
their replicas, so every round kills servers that every old worker still routes to: a
first dead primary in a backend, or a second one. The round runs what the reloader does around
a reload, with OldWorkers.run() polling beside it:

    build the effective config -> `haproxy -c`, and prepare (the steering worked out) while
    it runs -> before_reload (steer every worker, make-before-break) -> reload on the master
    CLI -> confirm with `show proc` -> after_reload

and measures, from the moment the new rendered text is in hand:
    to-steer  until HAProxy answered the last push that steers every worker that is old
              after the reload, minus HAProxy's own time in between: the check when it
              outlasted prepare (else nothing: prepare is then counted whole), and the
              reload when it falls in between. The target of issue 4: under 100 ms p99
              for 50 old workers and 10,000 servers
    overhead  everything but HAProxy's own time (build + prepare + before + after,
              bookkeeping included)
    prepare   the steering worked out while `haproxy -c` runs
    check     `haproxy -c`, started -> verdict in hand
    steered   until every old worker (and the one about to become old) holds its entries
    reload    HAProxy's own reload, `reload` sent -> new worker in `show proc`
    after     reload confirmed -> every old worker confirmed steered
A second measure needs no reload: an operator marks the next node's servers dead;
`marked` is the time until every old worker is steered and verified. `lag` is the event
loop's worst delay through each measured round (the reload and its push rounds), sampled
every 5 ms: how long anything else the daemon does (the operator API) may have waited.

    python -m bench.displaced_push                  # the full matrix (a few minutes)
    python -m bench.displaced_push --quick          # small sizes, a few rounds
    python -m bench.displaced_push --workers 50 --servers 10000 --rounds 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import psutil

from bench._doc import markdown_table
from bench._fleet import LagProbe, Master, Moved, drained, percentile, rendered, runtime_tmpdir, server_name
from rigs.harness import free_port, haproxy_binary
from rigs.wholes import known_dead_servers, steer_entries
from supervisor.daemon import watch_children_without_threads
from supervisor.effective import (
    build_effective,
    off_the_loop,
    prepare_runtime_dir,
    start_effective_check,
    write_slot_table,
)
from supervisor.eventloop import collector_paused, settle_after_reload
from supervisor.files import write_atomically
from supervisor.haproxy.api import CLIError, MasterCLI
from supervisor.haproxy.config import Config
from supervisor.settings import HAProxySettings, Settings
from supervisor.state import Generation, State, utcnow
from supervisor.steering import mapdiff
from supervisor.steering.dead import Sections
from supervisor.steering.mapdiff import map_entries
from supervisor.steering.workers import OldWorkers


@dataclass
class Figures:
    to_steered: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    build: list[float] = field(default_factory=list)
    prepare: list[float] = field(default_factory=list)
    check: list[float] = field(default_factory=list)
    steered: list[float] = field(default_factory=list)
    reload: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    marked: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)  # the event loop's worst lag through each round
    entries: list[int] = field(default_factory=list)
    rss_mb: float = 0.0


class Bench:
    def __init__(self, workers: int, servers: int, gc_policy: bool = True) -> None:
        self.gc_policy = gc_policy
        self.workers = workers
        self.servers = servers
        self.rundir = runtime_tmpdir("hsb-")
        self.settings = Settings(haproxy=HAProxySettings(runtime_dir=self.rundir))
        self.front = free_port()
        self.moved: Moved = {}
        self.holders: list[tuple[int, socket.socket]] = []  # (worker pid, its idle connection)
        self.state = State()
        self.master: Master | None = None

    def hold(self, pid: int) -> None:
        sock = socket.create_connection(("127.0.0.1", self.front))
        self.holders.append((pid, sock))

    def register(self, model: Config, effective_sha: str, pid: int) -> None:
        number = (self.state.current_generation or 0) + 1
        self.state.generations[number] = Generation(number, model, effective_sha, "", utcnow(), pid)
        self.state.current_generation = number

    async def reload(self, cli: MasterCLI, displaced: OldWorkers, text: str, figures: Figures | None) -> None:
        # The reloader's gc policy: no collection in the cycle, then collect and freeze.
        with collector_paused() if self.gc_policy else contextlib.nullcontext():
            await self._reload(cli, displaced, text, figures)
        if self.gc_policy:
            settle_after_reload()

    async def _reload(self, cli: MasterCLI, displaced: OldWorkers, text: str, figures: Figures | None) -> None:
        started = time.monotonic()
        # In a thread, as the reloader builds it: a build on the loop would be lag the daemon has not.
        effective = await off_the_loop(lambda: build_effective(self.settings, text))
        model = effective.effective_model  # what the reloader uses
        built = time.monotonic()
        # What the reloader does: check the config, and work the steering out meanwhile.
        check = await start_effective_check(replace(self.settings.haproxy, binary=haproxy_binary()), effective)
        spawned = time.monotonic()
        plan = await displaced.prepare(effective)
        prepared = time.monotonic()
        valid, message = await check.verdict()
        checked = time.monotonic()
        assert valid, message
        # HAProxy's own time, when the check outlasted prepare: we were waiting on it. When it
        # did not, its end is not known: none of it is taken off (prepare is counted whole).
        check_s = checked - spawned if checked - prepared > 0.001 else 0.0
        before_pid = self.state.current.worker_pid if self.state.current else None
        push_record = displaced.rounds.last_push
        plan = await displaced.before_reload(plan)
        steered = time.monotonic()
        # When HAProxy answered the last push of the make-before-break (bookkeeping after it excluded).
        last = displaced.rounds.last_push
        answered = last["steered_at"] if last is not push_record else steered
        write_slot_table(effective.slot_table)
        write_atomically(self.settings.haproxy.effective_config, effective.text)
        reload_start = time.monotonic()
        with contextlib.suppress(CLIError):
            await cli.reload()
        new_pid = None
        while new_pid is None:
            with contextlib.suppress(CLIError):
                current = (await cli.show_proc()).current_worker
                if current is not None and current.pid != before_pid:
                    new_pid = current.pid
            if new_pid is None:
                await asyncio.sleep(0.005)
        confirmed = time.monotonic()
        self.register(model, effective.sha256, new_pid)
        push_record = displaced.rounds.last_push
        await displaced.after_reload(plan, True)
        done = time.monotonic()
        if figures is not None:
            reload_s = confirmed - reload_start
            figures.reload.append(reload_s)
            figures.overhead.append(done - started - reload_s - (checked - prepared))
            if displaced.rounds.last_push is not push_record:  # steering had to be finished after the reload
                figures.to_steered.append(displaced.rounds.last_push["steered_at"] - started - check_s - reload_s)
            else:
                figures.to_steered.append(answered - started - check_s)
            figures.build.append(built - started)
            figures.prepare.append(prepared - spawned)
            figures.check.append(checked - spawned)
            figures.steered.append(steered - started)
            figures.after.append(done - confirmed)
            figures.entries.append(int(displaced.rounds.last_push.get("changes", 0)))

    async def release_oldest(self) -> None:
        pid, sock = self.holders.pop(0)
        sock.close()
        for _ in range(1000):  # the old worker exits once its last connection is gone
            with contextlib.suppress(psutil.NoSuchProcess):
                if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return
            await asyncio.sleep(0.01)

    def all_steered(self) -> bool:
        return all(w.push.state == "ok" for w in self.state.old_workers.values())

    async def check_maps(self, cli: MasterCLI) -> None:
        """Untimed: every old worker's map, read back, is what the straightforward decision
        (known_dead_servers, then steer_map_entries, no cache and no increment) says it needs."""
        current = self.state.current
        assert current is not None
        by_pid = {g.worker_pid: g for g in self.state.generations.values()}
        for pid in self.state.old_workers:
            generation = by_pid[pid]
            dead = known_dead_servers(generation.model, current.model, [], ())
            expected = steer_entries(Sections().digest(generation.model), dead, self.settings.old_workers.no_backup)
            got = map_entries(await cli.on(pid, f"show map {self.settings.haproxy.steer_map}"))
            differ = sorted(set(got.items()) ^ set(expected.items()))[:4]
            assert got == expected, f"worker {pid}: its map differs from the decision: {differ}"

    async def run(self, rounds: int) -> Figures:
        figures = Figures()
        prepare_runtime_dir(self.settings)
        text = rendered(self.servers, self.front, self.moved)
        effective = build_effective(self.settings, text)
        write_slot_table(effective.slot_table)
        write_atomically(self.settings.haproxy.effective_config, effective.text)
        self.master = Master(self.settings.haproxy.effective_config, self.rundir)
        try:
            cli = MasterCLI(self.master.socket, timeout=30)
            displaced = OldWorkers(self.settings, self.state, cli)
            pid = await self.master.first_worker(cli)
            self.register(effective.effective_model, effective.sha256, pid)
            poller = asyncio.create_task(displaced.run())
            probe = LagProbe()
            prober = asyncio.create_task(probe.run())
            try:
                # W old workers, each kept alive by one idle connection.
                for i in range(self.workers):
                    self.hold(self.state.current.worker_pid)
                    await self.reload(cli, displaced, text.replace("maxconn 2000", f"maxconn {2001 + i}"), None)
                for round_no in range(rounds):
                    for server in drained(self.servers, round_no):
                        self.moved[server] = round_no + 1
                    self.hold(self.state.current.worker_pid)
                    probe.worst = 0.0
                    await self.reload(cli, displaced, rendered(self.servers, self.front, self.moved), figures)
                    figures.lag.append(probe.worst)
                    assert self.all_steered(), [(w.pid, w.push) for w in self.state.old_workers.values()]
                    await self.check_maps(cli)
                    await self.release_oldest()
                    # Without a reload: the operator marks the next node dead.
                    doomed = [f"app{b}/{server_name(b, r, self.moved)}" for b, r in drained(self.servers, round_no + 1)]
                    started = time.monotonic()
                    for key in doomed:
                        displaced.mark_dead(key)
                    await displaced.sync()
                    figures.marked.append(time.monotonic() - started)
                    assert self.all_steered()
                    for key in doomed:
                        displaced.unmark_dead(key)
                    await displaced.sync()
                    # Generations whose worker is gone are forgotten, as the daemon does.
                    alive = {w.pid for w in self.state.old_workers.values()} | {self.state.current.worker_pid}
                    for number in [n for n, g in self.state.generations.items() if g.worker_pid not in alive]:
                        del self.state.generations[number]
                pids = [*self.state.old_workers, self.state.current.worker_pid]
                figures.rss_mb = sum(psutil.Process(p).memory_info().rss for p in pids) / 2**20
            finally:
                for task in (poller, prober):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        finally:
            for _, sock in self.holders:
                sock.close()
            self.master.stop()
            shutil.rmtree(self.rundir, ignore_errors=True)
        return figures


def report(workers: int, servers: int, f: Figures) -> None:
    def ms(samples: list[float]) -> str:
        return f"{percentile(samples, 0.5) * 1000:7.1f} {percentile(samples, 0.99) * 1000:7.1f}"

    print(
        f"{workers:>4} {servers:>6} {len(f.overhead):>3}  {ms(f.to_steered)}  {ms(f.overhead)}  {ms(f.build)}"
        f"  {ms(f.prepare)}  {ms(f.check)}  {ms(f.steered)}  {ms(f.reload)}  {ms(f.after)}  {ms(f.marked)}"
        f"  {ms(f.lag)}  {f.rss_mb:8.0f}",
        flush=True,
    )


def one_line(workers: int, servers: int, rounds: int) -> Figures:
    """One combination, as `--line-only` runs it (section() calls it in a fresh process)."""
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    watch_children_without_threads()  # as `haproxy-supervisor run` does
    return asyncio.run(Bench(workers, servers).run(rounds))


# docs/benchmarks.md's combinations (old workers, servers): the fleet size of the targets, and a
# small config for scale (16 x 10,000 would add half again to make bench's time).
SECTION = ((50, 10_000), (1, 10))
QUICK = ((1, 10), (2, 100))


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: p50 / p99 over 20 rounds (3 when quick), each line in a fresh process."""
    rounds = 3 if quick else 20
    found = []
    for workers, servers in QUICK if quick else SECTION:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            f = pool.submit(one_line, workers, servers, rounds).result()

        def ms(samples: list[float]) -> str:
            return f"{percentile(samples, 0.5) * 1000:.1f} / {percentile(samples, 0.99) * 1000:.1f}"

        found.append((workers, f"{servers:,}", len(f.overhead), ms(f.to_steered), ms(f.overhead), ms(f.build),
                      ms(f.prepare), ms(f.check), ms(f.steered), ms(f.reload), ms(f.after), ms(f.marked),
                      ms(f.lag), f"{f.rss_mb:.0f}"))
    header = ("W", "S", "rounds", "to-steer", "overhead", "build", "prepare", "check", "steered", "reload", "after",
              "marked", "lag", "RSS MB")
    return markdown_table(header, found)


def without_hops() -> None:
    """Every server that overrides leave is left by changing the overrides themselves, in the
    routing phases (what diff_phases does where a hop cannot be had), instead of by a hop."""
    real = mapdiff._hops

    def no_hops(current, desired, slot_sets, slots_gone):  # type: ignore[no-untyped-def]
        hops, urgent = real(current, desired, slot_sets, slots_gone)
        for hop in hops:
            backend, _, server = hop.partition("/")
            urgent.setdefault(backend, set()).add(server)
        return {}, urgent

    mapdiff._hops = no_hops
    mapdiff.backend_delta.cache_clear()


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # runs the finally blocks that stop HAProxy


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    parser = argparse.ArgumentParser(prog="python -m bench.displaced_push", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,10,50", help="old-worker counts, comma-separated")
    parser.add_argument("--servers", default="10,1000,10000", help="server counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=20, help="drains measured per combination")
    parser.add_argument("--quick", action="store_true", help="1 and 10 workers, 10 and 1000 servers, 5 rounds")
    parser.add_argument(
        "--no-gc-policy",
        action="store_true",
        help="the control: skip the daemon's gc policy (collector paused in the cycle, then gc.freeze)",
    )
    parser.add_argument(
        "--no-hops",
        action="store_true",
        help="the control: an override whose target dies is changed with `set map` in the routing phases, no hop",
    )
    parser.add_argument("--line-only", action="store_true", help=argparse.SUPPRESS)  # one line, no header
    args = parser.parse_args(argv or [])
    if args.quick:
        args.workers, args.servers, args.rounds = "1,10", "10,1000", 5
    combinations = [(int(w), int(s)) for s in args.servers.split(",") for w in args.workers.split(",")]
    if not args.line_only:
        print(
            f"displaced push: {args.rounds} drains per line, milliseconds as p50 p99 (p99 = max below 100 samples)",
            flush=True,
        )
        print(
            "   W      S   n  to-steer p50/p99  overhead p50/p99    build p50/p99  prepare p50/p99    check p50/p99"
            "  steered p50/p99   reload p50/p99"
            "    after p50/p99   marked p50/p99      lag p50/p99  RSS MB",
            flush=True,
        )
    if args.no_hops:
        without_hops()
    if len(combinations) == 1:
        workers, servers = combinations[0]
        watch_children_without_threads()  # as `haproxy-supervisor run` does
        report(workers, servers, asyncio.run(Bench(workers, servers, not args.no_gc_policy).run(args.rounds)))
        return 0
    for workers, servers in combinations:
        # Each line in a process of its own, as a daemon runs one fleet's config all its life:
        # one process for the whole matrix carries the heap of the lines before into the next
        # (the 50 x 10,000 line's build then reads ~37 ms instead of ~27).
        command = [sys.executable, "-m", "bench.displaced_push", "--line-only", "--rounds", str(args.rounds)]
        command += ["--workers", str(workers), "--servers", str(servers)]
        if args.no_gc_policy:
            command.append("--no-gc-policy")
        if args.no_hops:
            command.append("--no-hops")
        child = subprocess.Popen(command)
        try:
            code = child.wait()
        except BaseException:
            child.terminate()  # its SIGTERM handler stops the HAProxy it started
            child.wait()
            raise
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
