"""What the push benchmarks stage: a rendered config of S servers in backends of ten primaries
and a backup, the nodes drained from it round after round, an HAProxy master over it, and the
event loop's lag measured meanwhile (bench.displaced_push, bench.daemon_idle, bench.config_parse)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

from rigs.harness import haproxy_binary, kill_tree
from supervisor.haproxy.api import CLIError, MasterCLI

PER_BACKEND = 10
TMPFS = Path("/dev/shm")


def runtime_tmpdir(prefix: str) -> Path:
    """A runtime_dir for the fleet on a tmpfs, as the daemon's is under systemd (RuntimeDirectory=,
    in /run): on a disk, writing the check's copy of a 10,000-server config can wait on the
    journal, a stall the daemon does not have. /tmp where there is no /dev/shm."""
    parent = TMPFS if TMPFS.is_dir() and os.access(TMPFS, os.W_OK) else Path("/tmp")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


Moved = dict[tuple[int, int], int]  # (backend, replica) -> the round that moved it to a new address


def server_name(backend: int, replica: int, moved: Moved) -> str:
    when = moved.get((backend, replica))
    return f"app{backend}_r{replica}" if when is None else f"app{backend}_m{when}"


def rendered(servers: int, front: int, moved: Moved) -> str:
    backends = max(1, servers // PER_BACKEND)
    out = [
        "global\n    hard-stop-after 600s\n    close-spread-time 600s\n    maxconn 2000\n",
        "defaults\n    mode http\n    timeout connect 1s\n    timeout client 600s\n    timeout server 600s\n",
        # The idle connections that keep each old worker alive: TCP streams still waiting
        # for their first bytes survive soft-stop.
        f"frontend hold\n    mode tcp\n    bind 127.0.0.1:{front}\n    tcp-request inspect-delay 600s\n"
        "    tcp-request content accept if { req.len gt 0 }\n    default_backend app0\n",
    ]
    for b in range(backends):
        out.append(f"backend app{b}\n    balance roundrobin\n")
        for r in range(min(PER_BACKEND, servers)):
            port = 20000 + (b * PER_BACKEND + r) % 40000
            when = moved.get((b, r))
            host = f"127.0.1.{b % 250 + 1}" if when is None else f"127.0.2.{when % 250 + 1}"
            out.append(f"    server {server_name(b, r, moved)} {host}:{port}\n")
        out.append(f"    server fallback 127.0.0.1:{19000 + b % 1000} backup\n")
    return "".join(out)


def drained(servers: int, round_no: int) -> list[tuple[int, int]]:
    """(backend, replica) of the servers on the node drained in this round: 1% of the servers,
    one per backend; replica 0 of each backend in the first pass over them, then 1, and so on."""
    backends = max(1, servers // PER_BACKEND)
    per_node = min(max(1, servers // 100), backends)
    passes, within = divmod(round_no * per_node, backends)
    replica = passes % min(PER_BACKEND, servers)
    return [((within + i) % backends, replica) for i in range(per_node)]


def percentile(samples: list[float], q: float) -> float:
    """Nearest rank: with fewer than 100 samples the p99 is the maximum."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]


class LagProbe:
    """The event loop's worst lag since the last reset, sampled every few milliseconds."""

    INTERVAL_S = 0.005

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.INTERVAL_S
            await asyncio.sleep(self.INTERVAL_S)
            self.worst = max(self.worst, loop.time() - due)


class Master:
    """`haproxy -W -S` with its output in a file: at soft-stop every old worker writes a line
    per proxy, and with thousands of backends an undrained pipe blocks the whole process."""

    def __init__(self, config: Path, runtime: Path) -> None:
        self.socket = runtime / "master.sock"
        self.log = (runtime / "haproxy.log").open("wb")
        self.proc = subprocess.Popen(
            [haproxy_binary(), "-W", "-S", str(self.socket), "-f", str(config)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    async def first_worker(self, cli: MasterCLI) -> int:
        for _ in range(3000):
            with contextlib.suppress(CLIError, FileNotFoundError):
                if self.socket.exists():
                    current = (await cli.show_proc()).current_worker
                    if current is not None:
                        return current.pid
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}: see {self.log.name}")
            await asyncio.sleep(0.01)
        raise TimeoutError("no first worker")

    def stop(self) -> None:
        kill_tree(self.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.log.close()
