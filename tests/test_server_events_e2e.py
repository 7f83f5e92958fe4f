"""HAProxy's server state lines as the steering's event source, with the real daemon and binary:
a checked node at rest reads no state but the safety net's, a stopped server is heard within
its check time, a restarted daemon that adopts the master hears it again, and HAProxy's lines
still reach the daemon's stderr."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from rigs.daemon import Daemon
from rigs.harness import Backend, KeepAliveClient, backends, free_port
from tests.support.faults import metrics, status

pytestmark = pytest.mark.haproxy

READS = "haproxy_supervisor_server_state_reads_total"
CHECK_S = 0.2  # inter 200ms fall 1: a stopped server is DOWN within one check
MARGIN_S = 1.5  # the poll wakes at once; the rest is a read, a plan and a push on a busy machine
SAFETY_NET_S = 300  # so long that no safety-net read can be what found a change

RENDERED = """\
global
    hard-stop-after 60s
    close-spread-time infinite
{global_extra}
defaults
    mode http
    timeout connect 500ms
    timeout check 300ms
    timeout client 30s
    timeout server 30s
    option idle-close-on-response
    retries 1

frontend fe
    bind 127.0.0.1:{front}
    default_backend app

backend app
    # {tag}
    server r1 127.0.0.1:{r1} check inter 200ms fall 1 rise 1
    server r2 127.0.0.1:{r2} check inter 200ms fall 1 rise 1
    server fallback 127.0.0.1:{fallback} check inter 200ms backup
"""


@dataclass
class Node:
    daemon: Daemon
    started: dict[str, Backend]
    old_pid: int


@contextlib.asynccontextmanager
async def checked_node(make, quiet: bool = False) -> AsyncIterator[Node]:
    """The daemon on a checked backend, with one old worker holding keep-alive connections."""
    front = free_port()
    with backends("r1", "r2", "fallback") as started:
        ports = {name: b.port for name, b in started.items()}

        def rendered(tag: str) -> str:
            return RENDERED.format(front=front, tag=tag, global_extra="    quiet\n" if quiet else "", **ports)

        d = make(
            rendered("v1"),
            {"old_workers": {"guard": True, "poll_interval_ms": 250, "state_read_interval_s": SAFETY_NET_S}},
        )
        d.start()
        old_pid = await d.wait_generation(1)
        clients = [await KeepAliveClient(front).connect() for _ in range(2)]
        try:
            for client in clients:
                assert (await client.get())[0] == 200
            d.write(rendered("v2"))
            await d.wait_generation(2)
            await until(d, lambda doc: [w["pid"] for w in doc["old_workers"]] == [old_pid], "the old worker listed")
            yield Node(d, started, old_pid)
        finally:
            for client in clients:
                await client.close()


async def until(d: Daemon, predicate, what: str, timeout: float = 10.0) -> float:
    """Poll /status until predicate(doc); returns the seconds it took."""
    started = time.monotonic()
    while True:
        try:
            doc = await status(d)
        except aiohttp.ClientError as exc:  # a daemon just started: its status socket comes soon
            doc = {"error": str(exc)}
        if "error" not in doc and predicate(doc):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not {what} after {timeout}s: {doc}\n{d.run_log()}")
        await asyncio.sleep(0.02)


async def reads_at_rest(d: Daemon, seconds: float = 3.0) -> float:
    """Full state reads over `seconds` once the new worker's first checks have concluded."""
    await asyncio.sleep(1.0)
    before = (await metrics(d))[READS]
    await asyncio.sleep(seconds)
    return (await metrics(d))[READS] - before


async def steered_after_stop(node: Node, name: str) -> float:
    """Stop server `name`; seconds until the daemon has it dead and the old worker steered from it."""
    key = f"app/{name}"
    node.started[name].stop()
    return await until(
        node.daemon,
        lambda doc: key in doc["dead_servers"] and any(key in w["steered"] for w in doc["old_workers"]),
        f"{key} dead and steered",
    )


async def test_a_checked_node_at_rest_reads_states_only_as_a_safety_net(make):
    async with checked_node(make) as node:
        assert (await metrics(node.daemon))["haproxy_supervisor_server_events"] == 1
        assert await reads_at_rest(node.daemon) <= 1


async def test_control_quiet_haproxy_says_nothing_so_the_daemon_polls(make):
    """`quiet` in global: no line would come, so the current worker is read every poll."""
    async with checked_node(make, quiet=True) as node:
        assert await reads_at_rest(node.daemon) >= 6  # 3 s at 250 ms


async def test_a_stopped_server_is_heard_and_steered_within_its_check_time(make):
    async with checked_node(make) as node:
        d = node.daemon
        before = (await metrics(d))[READS]
        took = await steered_after_stop(node, "r1")
        assert took < CHECK_S + MARGIN_S, took
        assert (await metrics(d))[READS] - before <= 4  # read on the line, not polled
        # HAProxy's own line reached the daemon's stderr, unchanged.
        assert re.search(r"^\[WARNING\]  \(\d+\) : Server app/r1 is DOWN, reason: ", d.run_log(), re.M), d.run_log()


async def test_a_restarted_daemon_adopts_the_master_and_still_hears_it(make):
    async with checked_node(make) as node:
        d = node.daemon
        master = d.remember_master()
        d.signal(signal.SIGQUIT)  # the daemon leaves, HAProxy stays
        assert await d.wait_exit() == 3
        d.start()
        await d.wait_log(rf"master adopted pid={master} .*server_events=heard")
        await until(d, lambda doc: [w["pid"] for w in doc["old_workers"]] == [node.old_pid], "the old worker listed")
        assert (await metrics(d))["haproxy_supervisor_server_events"] == 1
        assert await reads_at_rest(d) <= 1
        took = await steered_after_stop(node, "r2")
        assert took < CHECK_S + MARGIN_S, took
        assert re.search(r"^\[WARNING\]  \(\d+\) : Server app/r2 is DOWN", d.run_log(), re.M), d.run_log()


async def test_a_line_a_full_fifo_refused_is_made_up_for_by_a_read(make):
    """The daemon stopped, its FIFO filled, HAProxy's DOWN line is refused (the write would block).
    Continued, the daemon finds the pipe full and reads the states again: the server is steered
    at once, not found by the safety net five minutes later."""
    async with checked_node(make) as node:
        d = node.daemon
        filler = b"[NOTICE]   (1) : filler " + b"f" * 100 + b"\n"
        d.signal(signal.SIGSTOP)
        try:
            writer = os.open(d.runtime / "haproxy.stderr", os.O_WRONLY | os.O_NONBLOCK)
            try:
                with contextlib.suppress(BlockingIOError):
                    for _ in range(20_000):  # 1 MiB of pipe at most
                        os.write(writer, filler)
            finally:
                os.close(writer)
            node.started["r1"].stop()
            await asyncio.sleep(5 * CHECK_S)  # checked and found DOWN; its line cannot be written
        finally:
            d.signal(signal.SIGCONT)
        key = "app/r1"
        await until(
            d, lambda doc: key in doc["dead_servers"] and any(key in w["steered"] for w in doc["old_workers"]),
            f"{key} dead and steered", timeout=MARGIN_S + 3,
        )
        assert "stderr FIFO is full" in d.log()
