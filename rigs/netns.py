"""Run a function in a network namespace of its own, in a forked child: traffic there cannot
reach anything outside, and nftables rules made there vanish with it. Needs root (CAP_SYS_ADMIN)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import subprocess
import traceback
from collections.abc import Callable
from typing import Any

import pytest

CLONE_NEWNET = 0x40000000


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("nft") is not None and shutil.which("ip") is not None


needs_netns = pytest.mark.skipif(not netns_available(), reason="needs root, ip and nft for a network namespace")


def _child(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    try:
        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        out.send(("ok", fn(*args, **kwargs)))
    except BaseException:
        out.send(("error", traceback.format_exc()))
    finally:
        out.close()


def run_in_netns(fn: Callable[..., Any], *args: Any, timeout: float = 60, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a child in a new network namespace; its return value (picklable), or the
    child's traceback raised here as an AssertionError."""
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_child, args=(fn, args, kwargs, send))
    child.start()
    send.close()
    try:
        if not receive.poll(timeout):
            raise AssertionError(f"the namespaced child gave no answer in {timeout}s")
        kind, value = receive.recv()
    finally:
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, 9)
        child.join(5)
    if kind != "ok":
        raise AssertionError(value)
    return value


def nft(rules: str) -> None:
    """Load nftables rules (in the caller's namespace)."""
    subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True)


def drop_port(port: int, both_ways: bool = False) -> None:
    """Black-hole `port`: packets to it dropped (and from it, with `both_ways`: a partition).
    Dropped as they arrive, as a remote node's loss is seen: a packet dropped on its way out
    fails to send, and TCP then arms a zero-window probe instead of its retransmit timer."""
    extra = f"\n        tcp sport {port} drop" if both_ways else ""
    nft(f"table inet vanish_{port} {{\n    chain in {{\n        type filter hook input priority 0\n"
        f"        tcp dport {port} drop{extra}\n    }}\n}}\n")


def lift_drop(port: int) -> None:
    subprocess.run(["nft", "delete", "table", "inet", f"vanish_{port}"], check=True)
