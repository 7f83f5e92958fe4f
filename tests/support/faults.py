"""Helpers for the fault suite (tests/faults/): a small filesystem to fill or make read-only,
and the daemon's own view of convergence, read over its status socket.

Everything stays on this machine: the filesystems are tmpfs mounts under the test's own
directory (unmounted by the test), the daemon is reached on its unix socket, traffic goes
to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from rigs.daemon import Daemon, Node, _metric_values, http_get, one_backend
from supervisor.haproxy.api import CLIError

# Settings that make every fault quick to show and to clear: a short reload timeout (3.x starts a
# worker in about a second on a busy 2-core machine), retries at most a second apart, /readyz 503
# after a second without the rendered config.
FAST_CONVERGE = {"reload": {"timeout_s": 2, "retry_max_s": 1, "converge_grace_s": 1}}


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (created), unmounted lazily afterwards: the daemon and
    HAProxy may still hold files in it when the test ends; the kernel frees it once they are gone."""
    path.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        _run("umount", "--lazy", str(path))


def remount(path: Path, mode: str) -> None:
    """`ro` or `rw`."""
    done = _run("mount", "-o", f"remount,{mode}", str(path))
    assert done.returncode == 0, done.stderr


def fill(directory: Path) -> Path:
    """Fill the filesystem holding `directory` to the last byte; returns the filler file."""
    filler = directory / ".filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (65536, 4096, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    return filler


# ---------------------------------------------------------------- the daemon's view


async def get(daemon: Daemon, path: str) -> tuple[int, str]:
    connector = aiohttp.UnixConnector(path=str(daemon.directory / "status.sock"))
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, session.get(
        f"http://daemon{path}"
    ) as r:
        return r.status, await r.text()


async def status(daemon: Daemon) -> dict:
    code, text = await get(daemon, "/status")
    assert code == 200, text
    return json.loads(text)


async def metrics(daemon: Daemon) -> dict[str, float]:
    code, text = await get(daemon, "/metrics")
    assert code == 200, text
    return _metric_values(text)


async def readyz(daemon: Daemon) -> tuple[int, str]:
    code, text = await get(daemon, "/readyz")
    return code, json.loads(text).get("error", "")


async def wait_unready(daemon: Daemon, timeout: float = 10) -> str:
    """Wait for /readyz 503; returns its reason."""
    deadline = time.monotonic() + timeout
    while True:
        code, reason = await readyz(daemon)
        if code == 503:
            return reason
        if time.monotonic() > deadline:
            raise TimeoutError(f"/readyz still 200 after {timeout}s\n{daemon.run_log()}")
        await asyncio.sleep(0.1)


async def wait_converged(daemon: Daemon, front: int, tag: str, timeout: float) -> float:
    """Wait until the node runs the rendered config: HAProxy answers with `tag`, the daemon says
    converged, /readyz is 200, and /status names the worker `show proc` lists as current.
    Returns the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    seen = ""
    while True:
        _, headers, _ = await http_get(front, timeout=2)
        if headers.get("x-tag") == tag:
            try:
                doc = await status(daemon)
                procs = await daemon.show_proc()
                ready, _ = await readyz(daemon)
            except (aiohttp.ClientError, CLIError) as exc:  # a daemon starting, a master re-executing
                doc, procs, ready = None, None, 0
                seen = str(exc)
            current = procs.current_worker if procs is not None else None
            if doc is not None:
                seen = f"convergence={doc['convergence']} worker={doc['worker']} show proc current={current}"
            if (
                doc is not None
                and doc["convergence"]["converged"]
                and ready == 200
                and current is not None
                and doc["worker"]["pid"] == current.pid
            ):
                return time.monotonic() - started
        if time.monotonic() > deadline:
            raise TimeoutError(f"not converged to {tag!r} within {timeout}s: {seen}\n{daemon.run_log()}")
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------- a node under a request loop


@contextlib.asynccontextmanager
async def serving(make, settings: dict | None = None, settled_s: float | None = 0.5) -> AsyncIterator[Node]:
    """A daemon on config "v1" with FAST_CONVERGE settings, its first worker serving, and a
    bounded request loop through it (stopped on the way out). Throughout, `Honesty` samples
    that the daemon never says converged while HAProxy serves another config (`settled_s`:
    how long a write has to reach the daemon; None: not sampled); a lie fails the test."""
    settings = settings or FAST_CONVERGE
    async with one_backend(make, settings) as node:
        loop = node.requests(max_requests=4000, max_seconds=40)
        honesty = None
        if settled_s is not None:
            grace = settings.get("reload", {}).get("converge_grace_s", 60)
            honesty = node.honesty = Honesty(node.daemon, node.front, grace_s=grace, settled_s=settled_s).start()
        await asyncio.sleep(0.3)
        try:
            yield node
        finally:
            await loop.stop()
            if honesty is not None:
                await honesty.stop()
    if honesty is not None:
        assert not honesty.lies, f"{len(honesty.lies)} lies of {honesty.samples} samples: {honesty.lies[:5]}"


# ---------------------------------------------------------------- the promise /readyz makes


class Honesty:
    """While a fault runs: the daemon never says converged (nor /readyz 200 past the grace
    period) while HAProxy serves a config other than the rendered one.

    Samples in a bounded loop: the rendered file as HAProxy would read it (following every
    symlink), /status and /readyz, then the tag a new connection is answered with. A sample
    counts only when the file's content has not changed for `settled_s` before it and during
    it (the daemon learns of a write a moment after it lands), and HAProxy answered. /readyz
    counts only while what stands in the way is transient: a config HAProxy refuses or that is
    invalid keeps the node ready on its last good config by design (not_ready_reason). A lie
    is recorded as a line.
    """

    TAG = re.compile(r"x-tag (\S+)")

    def __init__(self, daemon: Daemon, front: int, grace_s: float, settled_s: float = 0.5,
                 max_samples: int = 2000, max_seconds: float = 60) -> None:
        self.daemon = daemon
        self.front = front
        self.grace_s = grace_s
        self.settled_s = settled_s
        self.max_samples = max_samples
        self.max_seconds = max_seconds
        self.samples = 0  # the samples that counted
        self.lies: list[str] = []
        self._seen: tuple[bytes | None, float] = (None, 0.0)  # content, first seen at
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> Honesty:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def _content(self) -> bytes | None:
        try:
            content = self.daemon.rendered.read_bytes()
        except OSError:
            content = None
        if content != self._seen[0]:
            self._seen = (content, time.monotonic())
        return content

    async def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        taken = 0
        while not self._stop.is_set() and taken < self.max_samples and time.monotonic() < deadline:
            taken += 1
            await asyncio.sleep(0.05)
            before = self._content()
            settled = time.monotonic() - self._seen[1] >= self.settled_s
            try:
                doc = await status(self.daemon)
                ready, _ = await readyz(self.daemon)
                # /status and /readyz are two requests: /readyz's answer is judged against the
                # state on both sides of it, as a refusal recorded in between makes 200 right.
                later = await status(self.daemon)
            except (aiohttp.ClientError, AssertionError, OSError, TimeoutError):
                continue
            _, headers, _ = await http_get(self.front, timeout=2)
            after = self._content()
            served = headers.get("x-tag")
            if before is None or before != after or not settled or served is None:
                continue
            self.samples += 1
            convergence = doc["convergence"]
            says_ready = convergence["converged"] or (
                ready == 200 and all(self._past_grace(d["convergence"]) for d in (doc, later))
            )
            match = self.TAG.search(before.decode(errors="replace"))
            rendered_tag = match[1] if match else None
            sha = hashlib.sha256(before).hexdigest()
            if says_ready and (served != rendered_tag or doc["config"]["rendered_sha256"] != sha):
                self.lies.append(
                    f"converged={convergence['converged']} readyz={ready} served={served!r} "
                    f"rendered={rendered_tag!r} status sha={str(doc['config']['rendered_sha256'])[:12]} "
                    f"file sha={sha[:12]}"
                )

    def _past_grace(self, convergence: dict) -> bool:
        """Unconverged for a transient reason for longer than the grace period (and a second)."""
        return bool(convergence["transient"]) and (convergence["unconverged_s"] or 0) > self.grace_s + 1

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


# ---------------------------------------------------------------- the TCP status listener


async def tcp_request(port: int, path: str, host: str | None = "127.0.0.1", timeout: float = 2.0) -> tuple[int, bytes]:
    """One `GET path` to 127.0.0.1:port with this `Host` (None: no Host line at all); the
    status code and the body. OSError / TimeoutError when nothing answers."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = f"GET {path} HTTP/1.1\r\n" + (f"Host: {host}\r\n" if host is not None else "")
            writer.write(f"{head}Connection: close\r\n\r\n".encode())
            answer = await reader.read()
        finally:
            writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    parts = status_line.split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise OSError(f"no HTTP answer: {answer[:100]!r}")
    return int(parts[1]), rest.partition(b"\r\n\r\n")[2]


def cpu_seconds(pid: int) -> float:
    """The user and system CPU time of one process (not its children), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- the master CLI


def crowd(daemon: Daemon, count: int) -> list[socket.socket]:
    """Connections to the master CLI that say nothing and stay open."""
    held = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(daemon.runtime / "master.sock"))
        except BlockingIOError:  # the backlog is full: crowded enough
            sock.close()
            break
        held.append(sock)
    return held
