"""The command lines Ray Serve runs its HAProxy binary with, read the way HAProxy reads them.

Ray (ray/serve/_private/haproxy.py, HAProxyApi._start_and_wait_for_haproxy) runs
`<bin> -db -f <cfg> -dR` to start and `<bin> -db -f <cfg> [-dR] -sf <pid>... [-x <admin.sock>]`
to reload. Under the bridge the node's daemon owns HAProxy and does the reloading: `-sf`, `-x`,
`-dR` and `-db` are instructions to a process that no longer exists, kept only to tell a start
from a reload. A version query or a check (`-v`, `-vv`, `-c`) starts nothing: the daemon's own
binary answers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class UsageError(ValueError):
    """A command line HAProxy would refuse, or one the bridge cannot stand in for. One line."""


@dataclass(frozen=True)
class Run:
    """Start (or, with `-sf`, replace) the HAProxy that runs `config`."""

    config: Path
    soft_stop: tuple[int, ...] = ()  # -sf: the processes this one replaces (Ray signals them itself)
    hard_stop: tuple[int, ...] = ()  # -st
    sockets_from: Path | None = None  # -x: where HAProxy would fetch the listening sockets

    @property
    def replaces(self) -> bool:
        """Ray reloads (a manager that has run HAProxy before), as opposed to a first start."""
        return bool(self.soft_stop or self.hard_stop)


@dataclass(frozen=True)
class PassThrough:
    """A query that starts nothing (version, check, usage): the real binary answers it."""

    args: tuple[str, ...]


# Flags that only ask something, answered by the real binary as they are.
QUERIES = frozenset({"-v", "-vv", "-c", "-h", "--help", "-cc"})
# Flags without an argument that only shape how a process that does not exist would run.
IGNORED = frozenset({"-db", "-dR", "-dr", "-q", "-V", "-W", "-Ws", "-dV", "-dW", "-dM", "-de", "-dp", "-dS", "-dG"})
# Flags with one argument, ignored with it (`-x` is kept for the record).
IGNORED_WITH_ARGUMENT = frozenset({"-p", "-S", "-L", "-N", "-m", "-C"})


def parse_argv(args: list[str] | tuple[str, ...]) -> Run | PassThrough:
    """Ray's argument forms (and HAProxy's other read-only ones); UsageError for anything else."""
    if not args or any(a in QUERIES for a in args):
        return PassThrough(tuple(args))
    configs: list[Path] = []
    soft: list[int] = []
    hard: list[int] = []
    sockets_from: Path | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-sf", "-st"):
            pids = soft if arg == "-sf" else hard
            i += 1
            while i < len(args) and args[i].isascii() and args[i].isdigit():
                pids.append(int(args[i]))
                i += 1
            continue
        if arg in ("-f", "-x") or arg in IGNORED_WITH_ARGUMENT:
            if i + 1 >= len(args):
                raise UsageError(f"option {arg} needs an argument")
            value = args[i + 1]
            if arg == "-f":
                configs.append(Path(value))
            elif arg == "-x":
                sockets_from = Path(value)
            i += 2
            continue
        if arg == "-D":
            raise UsageError("-D (daemon mode) is not for the bridge: the node's haproxy-supervisor runs HAProxy")
        if arg in IGNORED:
            i += 1
            continue
        raise UsageError(f"unknown option {arg!r}")
    if len(configs) != 1:
        raise UsageError(f"the bridge runs exactly one config (-f FILE), got {len(configs)}")
    return Run(configs[0], tuple(soft), tuple(hard), sockets_from)
