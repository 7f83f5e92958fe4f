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


def held_ports(procs: list[psutil.Process]) -> tuple[set[int], set[tuple[int, int]]]:
    """The processes' TCP listening ports, and their connections as (local, remote) port pairs."""
    listening: set[int] = set()
    pairs: set[tuple[int, int]] = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for c in proc.net_connections(kind="tcp"):
                if c.raddr:
                    pairs.add((c.laddr.port, c.raddr.port))
                elif c.laddr:
                    listening.add(c.laddr.port)
    return listening, pairs


def drop_rules(ports: set[int], pairs: set[tuple[int, int]] = frozenset()) -> str:
    """nftables rules under which packets to or from the listening ports, and those of the
    connections (local, remote port pairs), vanish both ways. A connection is matched by its
    pair, not by its local port alone: an ephemeral port number is reused on loopback by other
    processes' connections (a client of the head), which must not vanish with it."""
    sets = f"  set gone {{ type inet_service; elements = {{ {', '.join(str(p) for p in sorted(ports))} }} }}\n"
    rules = "tcp dport @gone drop; tcp sport @gone drop;"
    if pairs:
        elements = ", ".join(f"{a} . {b}" for a, b in sorted(pairs))
        sets += f"  set pairs {{ type inet_service . inet_service; elements = {{ {elements} }} }}\n"
        rules += " tcp sport . tcp dport @pairs drop; tcp dport . tcp sport @pairs drop;"
    chains = "".join(
        f"  chain {hook} {{ type filter hook {hook} priority 0; policy accept; {rules} }}\n"
        for hook in ("output", "input")
    )
    return f"table inet vanished {{\n{sets}{chains}}}\n"


def drop_ports(ports: set[int], pairs: set[tuple[int, int]] = frozenset()) -> None:
    """Only inside the benchmark's own network namespace."""
    subprocess.run(["nft", "-f", "-"], input=drop_rules(ports, pairs).encode(), check=True)


def vanish(pids: list[int], keep: frozenset[int] = frozenset()) -> tuple[int, set[int]]:
    """The node leaves the network, then its processes die: how many listening ports and
    connections dropped, and the node's ports among them (its listeners, its ends of connections).
    `keep`: ports left open (another node's listener the processes hold a connection to)."""
    procs = [p for pid in pids for p in tree(pid)]
    listening, pairs = held_ports(procs)
    ports = listening - keep
    pairs = {(a, b) for a, b in pairs if a not in keep and b not in keep}
    drop_ports(ports, pairs)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
    return len(ports) + len(pairs), ports | {a for a, _ in pairs}
