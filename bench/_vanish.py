"""A node that vanishes, inside a network namespace of the caller's own: its ports dropped by
nftables both ways (neither SYNs nor the dying processes' FIN/RST pass), then its processes killed."""

from __future__ import annotations

import contextlib
import subprocess

import psutil


def tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    return []


def held_ports(procs: list[psutil.Process]) -> set[int]:
    """Every local TCP port the processes hold: listeners and their ends of connections."""
    ports = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            ports.update(c.laddr.port for c in proc.net_connections(kind="tcp") if c.laddr)
    return ports


def drop_rules(ports: set[int]) -> str:
    """nftables rules under which packets to or from the ports vanish, both ways."""
    elements = ", ".join(str(p) for p in sorted(ports))
    chains = "".join(
        f"  chain {hook} {{ type filter hook {hook} priority 0; policy accept; "
        f"tcp dport @gone drop; tcp sport @gone drop; }}\n"
        for hook in ("output", "input")
    )
    return f"table inet vanished {{\n  set gone {{ type inet_service; elements = {{ {elements} }} }}\n{chains}}}\n"


def drop_ports(ports: set[int]) -> None:
    """Only inside the benchmark's own network namespace."""
    subprocess.run(["nft", "-f", "-"], input=drop_rules(ports).encode(), check=True)


def vanish(pids: list[int], keep: frozenset[int] = frozenset()) -> tuple[int, set[int]]:
    """The node leaves the network, then its processes die: how many ports dropped, and which.
    `keep`: ports left open (another node's listener the processes hold a connection to)."""
    procs = [p for pid in pids for p in tree(pid)]
    ports = held_ports(procs) - keep
    drop_ports(ports)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
    return len(ports), ports
