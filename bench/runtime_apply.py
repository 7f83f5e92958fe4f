"""How long a reloadless apply of 1,000 slot changes takes, against the real HAProxy.

    python -m bench.runtime_apply [--slots 1000] [--rounds 5]

Scenarios, each timed as plan (parse both effective configs + plan) and apply (every
command sent and every answer checked, step by step across servers):

- enable: one `server-template` line of N parked slots filled (maint, addr, ready each);
- disable: the same N slots parked again (maint, addr each);
- readdress: N explicit `server` lines of live servers moved to another port
  (maint, addr, ready each).

For scale, the same master is also reloaded, timed until `show proc` shows the new worker.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._doc import markdown_table  # noqa: E402
from rigs.harness import HAProxyMaster, free_port, short_tmpdir  # noqa: E402
from rigs.wholes import plan_runtime_apply  # noqa: E402
from supervisor.haproxy.api import MasterCLI  # noqa: E402
from supervisor.haproxy.config import Config  # noqa: E402
from supervisor.haproxy.runtime.apply import apply_changes  # noqa: E402

PLACEHOLDER = "127.0.0.1:1"


def config_text(front: int, slots: int, slot_port: int | None, explicit_port: int) -> str:
    where = f"127.0.0.1:{slot_port}" if slot_port is not None else f"{PLACEHOLDER} disabled"
    explicit = "".join(f"    server e{i} 127.0.0.1:{explicit_port}\n" for i in range(1, slots + 1))
    return f"""\
global
    maxconn 1000

defaults
    mode http
    timeout connect 200ms
    timeout client 5s
    timeout server 5s

frontend fe
    bind 127.0.0.1:{front}
    default_backend slots

backend slots
    balance roundrobin
    server-template slot 1-{slots} {where}

backend explicit
    balance roundrobin
{explicit}"""


async def timed_apply(cli: MasterCLI, pid: int, old: str, new: str) -> tuple[float, float, int, int, int]:
    started = time.perf_counter()
    changes = plan_runtime_apply(Config.parse(old), Config.parse(new))
    planned = time.perf_counter()
    assert changes is not None
    result = await apply_changes(cli, pid, changes)
    applied = time.perf_counter()
    if not result.ok:
        raise RuntimeError(f"refused: {result.refused[:3]}")
    return (planned - started) * 1000, (applied - planned) * 1000, len(changes), result.commands_sent, result.lines_sent


Timing = tuple[float, float, int, int, int]  # plan ms, apply ms, servers, commands, lines


def median_of(rows: list[Timing]) -> tuple[int, int, int, float, float, float]:
    """servers, commands, lines, then the medians of plan and apply (ms) and the apply per server (us)."""
    plan_ms = statistics.median(r[0] for r in rows)
    apply_ms = statistics.median(r[1] for r in rows)
    servers, commands, lines = rows[0][2:]
    return servers, commands, lines, plan_ms, apply_ms, apply_ms * 1000 / servers


def median_row(name: str, rows: list[Timing]) -> str:
    servers, commands, lines, plan_ms, apply_ms, per_server_us = median_of(rows)
    return (
        f"{name:<10} {servers:>7} {commands:>8} {lines:>6} {plan_ms:>9.1f} {apply_ms:>9.1f} {per_server_us:>10.1f}"
    )


async def run(slots: int, rounds: int) -> tuple[str, dict[str, list[Timing]], float]:
    """HAProxy's version, each scenario's timings, and the median reload (ms)."""
    rundir = short_tmpdir("hs-bench-")
    front, port_a, port_b = free_port(), free_port(), free_port()
    cfg = rundir / "haproxy.cfg"
    parked = config_text(front, slots, None, port_a)
    filled = config_text(front, slots, port_b, port_a)
    moved = config_text(front, slots, None, port_b)
    cfg.write_text(parked)
    master = HAProxyMaster(cfg, rundir)
    try:
        master.start()
        cli = MasterCLI(master.socket, timeout=30)
        pid = master.worker_pids()[0]
        assert pid is not None
        enable, disable, readdress = [], [], []
        for _ in range(rounds):
            enable.append(await timed_apply(cli, pid, parked, filled))
            disable.append(await timed_apply(cli, pid, filled, parked))
            readdress.append(await timed_apply(cli, pid, parked, moved))
            readdress.append(await timed_apply(cli, pid, moved, parked))
        reloads = []
        for _ in range(rounds):
            started = time.perf_counter()
            master.reload()
            reloads.append((time.perf_counter() - started) * 1000)
        version = master.command("show version").strip()
        return version, {"enable": enable, "disable": disable, "readdress": readdress}, statistics.median(reloads)
    finally:
        master.stop()
        shutil.rmtree(rundir, ignore_errors=True)


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: 1,000 servers, 5 rounds (100 and 2 when quick)."""
    _, scenarios, reload_ms = asyncio.run(run(100 if quick else 1000, 2 if quick else 5))
    rows = [(name, *(f"{v:.1f}" if isinstance(v, float) else v for v in median_of(timings)))
            for name, timings in scenarios.items()]
    rows.append(("reload, for scale (until the new worker is in `show proc`)", "", "", "", "", f"{reload_ms:.1f}", ""))
    return markdown_table(["scenario", "servers", "commands", "lines", "plan ms", "apply ms", "us per server"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    version, scenarios, reload_ms = asyncio.run(run(args.slots, args.rounds))
    print(f"runtime apply, {args.slots} servers per scenario, median of {args.rounds} rounds (HAProxy {version}):")
    print(f"{'scenario':<10} {'servers':>7} {'commands':>8} {'lines':>6} {'plan ms':>9} {'apply ms':>9} "
          f"{'us/server':>10}")
    for name, timings in scenarios.items():
        print(median_row(name, timings))
    print(f"for scale: reload until the new worker shows in `show proc`: median {reload_ms:.1f} ms "
          "(and each reload leaves an old worker behind)")


if __name__ == "__main__":
    main()
