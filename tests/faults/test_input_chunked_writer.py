"""Fault: a controller rewrites the rendered config in place, in chunks, and pauses between them.

A chunk that ends with a section leaves a valid config without its last sections on disk. It
used to be loaded (and each change cost two reloads), and while the writer paused for longer
than the debounce the partial config was served with `converged: true`. Now only whole writes
are read: (a) a writer that holds a flock on `<file>.lock` (Ray Serve's convention) is waited
for, however many times it closes the file meanwhile; (b) a file open for writing is not read
until it is closed. The partial config is never loaded, nor reported converged.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import signal
import time

import pytest

from rigs.daemon import Node, http_get, tagged_config
from rigs.harness import free_port
from tests.support.faults import FAST_CONVERGE, serving, status, wait_converged

pytestmark = pytest.mark.haproxy

PAUSE_S = 2.5  # longer than the debounce (200 ms) and than the safety net's period (1 s)
SETTINGS = {"reload": {**FAST_CONVERGE["reload"], "debounce_ms": 200}}


def whole_and_partial(node: Node, extra_port: int) -> tuple[str, str]:
    """The new config, and its first part: valid on its own (it serves tag v2), without the
    last section (a listener on `extra_port`)."""
    partial = tagged_config(node.front, node.backend, "v2")
    whole = partial + f"\nlisten extra\n    bind 127.0.0.1:{extra_port}\n    server s1 {node.backend}\n"
    return whole, partial


async def watch_the_pause(node: Node, partial: str, seconds: float) -> list[str]:
    """Through the pause: a new connection must get the old config, and the daemon must not
    call the partial config converged. Returns what went wrong."""
    wrong = []
    sha = hashlib.sha256(partial.encode()).hexdigest()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _, headers, _ = await http_get(node.front, timeout=2)
        if headers.get("x-tag") != "v1":
            wrong.append(f"served {headers.get('x-tag')!r} while the config was half written")
        doc = await status(node.daemon)
        if doc["convergence"]["converged"] and doc["config"]["rendered_sha256"] == sha:
            wrong.append("the partial config reported converged")
        await asyncio.sleep(0.1)
    return wrong


async def check_whole_loaded(node: Node, extra_port: int, wrong: list[str], waited: str) -> None:
    """The whole config loaded, with one reload, after a cycle waited for the writer (`waited`:
    the reason it logged)."""
    d = node.daemon
    took = await wait_converged(d, node.front, "v2", timeout=10)
    status_code, _, _ = await http_get(extra_port, timeout=2)
    await asyncio.sleep(1.0)
    print(f"converged {took:.2f}s after the last chunk; {node.honesty.samples} honesty samples")
    assert not wrong, wrong[:5]
    assert status_code == 200, "the whole config's last section listens"
    assert d.count(r"reload ok") == 1, "one reload for one change"
    assert d.count(rf"reload waits: .* {waited}") == 1, d.run_log()
    assert not node.loop.failures, node.loop.failures[:5]
    assert d.count("Traceback") == 0


async def test_a_writer_under_a_flock_on_the_lock_file_is_waited_for(make):
    async with serving(make, SETTINGS) as node:
        d = node.daemon
        extra = free_port()
        whole, partial = whole_and_partial(node, extra)
        lock = os.open(d.rendered.with_name(d.rendered.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with d.rendered.open("w") as f:  # in place, as Ray does: truncate, write, close
                f.write(partial)
            wrong = await watch_the_pause(node, partial, PAUSE_S)
            with d.rendered.open("a") as f:
                f.write(whole[len(partial):])
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
        await check_whole_loaded(node, extra, wrong, waited="is locked by its writer")


async def test_a_file_open_for_writing_is_read_once_it_is_closed(make):
    async with serving(make, SETTINGS) as node:
        d = node.daemon
        extra = free_port()
        whole, partial = whole_and_partial(node, extra)
        with d.rendered.open("w") as f:  # one open, chunks written, one close
            f.write(partial)
            f.flush()
            # The writes in progress say "being written", only the close says "read"; a reload
            # asked for meanwhile (SIGHUP) must wait for the writer all the same.
            await asyncio.sleep(0.5)
            d.signal(signal.SIGHUP)
            wrong = await watch_the_pause(node, partial, PAUSE_S)
            f.write(whole[len(partial):])
        await check_whole_loaded(node, extra, wrong, waited="is open for writing")
