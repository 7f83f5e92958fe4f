"""The daemon as a real subprocess (`python -m supervisor run --config FILE`), for end-to-end tests.

Tests observe it through its log lines, the master CLI and the files in runtime_dir.
Every daemon and every HAProxy master it started is stopped by PID in cleanup(),
including masters left running after a `kill -9` of the daemon.

HTTP through HAProxy (rigs/http_requests.py) and the daemon as a "Supervised"
(rigs/daemon_supervised.py) live in modules of their own; their names are re-exported
here, where the tests and the benchmarks import them with the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from rigs.daemon_supervised import DaemonSupervised as DaemonSupervised
from rigs.daemon_supervised import StatusSnapshot as StatusSnapshot
from rigs.daemon_supervised import _metric_values as _metric_values
from rigs.harness import ROOT, backends, free_port, haproxy_binary, kill_tree
from rigs.http_requests import RequestLoop as RequestLoop
from rigs.http_requests import http_get as http_get
from supervisor.haproxy.answers import ProcList
from supervisor.haproxy.api import MasterCLI

RENDERED = """\
global
    hard-stop-after 30s

defaults
    mode http
    timeout connect 200ms
    timeout client 10s
    timeout server 10s
    retries 1

frontend fe
    bind 127.0.0.1:{front}
    http-response set-header x-tag {tag}
    default_backend app

backend app
    server s1 {backend}
"""


@dataclass(frozen=True)
class RunAs:
    """The user, group and supplementary groups a daemon runs as (a unit's User=, Group=,
    SupplementaryGroups=), and a python that user may run with the packages on `pythonpath`;
    the daemon runs as the test's own user without one."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    python: str = sys.executable
    pythonpath: tuple[str, ...] = ()


def tagged_config(front: int, backend: str, tag: str) -> str:
    """RENDERED with a frontend port, one backend server and the tag it stamps on responses."""
    return RENDERED.format(front=front, backend=backend, tag=tag)


def write_atomic(path: Path, text: str) -> None:
    """Rename into place, the way editors and controllers write."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Daemon:
    """One settings file and runtime_dir; `start()` may be called again after a stop or a kill."""

    def __init__(self, directory: Path, rendered: str, settings: dict | None = None) -> None:
        self.directory = directory
        self.rendered = directory / "rendered" / "haproxy.cfg"
        self.rendered.parent.mkdir(parents=True, exist_ok=True)
        if not self.rendered.exists() and not self.rendered.is_symlink():
            self.rendered.write_text(rendered)
        self.runtime = directory / "run"
        self.log_path = directory / "daemon.log"
        self.settings_path = directory / "settings.yaml"
        base: dict = {
            "haproxy": {
                "binary": haproxy_binary(),
                "config": str(self.rendered),
                "runtime_dir": str(self.runtime),
                "stop_timeout_s": 5,
            },
            "reload": {"debounce_ms": 80, "min_interval_ms": 0, "timeout_s": 10, "runtime_apply": False},
            "old_workers": {"guard": False},
            "logging": {"level": "info"},
            # Tests run side by side: never the default TCP port.
            "status": {"listen": f"unix:{directory / 'status.sock'}"},
        }
        for key, value in (settings or {}).items():
            base.setdefault(key, {}).update(value)
        self.settings_path.write_text(yaml.safe_dump(base))
        self.proc: subprocess.Popen | None = None
        self.masters: set[int] = set()
        self._log_offset = 0
        self.cli = MasterCLI(self.runtime / "master.sock", timeout=5)

    # ------------------------------------------------------------ process

    def start(
        self, env: dict[str, str] | None = None, run_as: RunAs | None = None, through: Sequence[str] = (),
    ) -> Daemon:
        """`through`: a command that execs the daemon in its place (`setpriv ...`), so its PID is the daemon's."""
        full_env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        full_env["PATH"] = full_env.get("PATH", "") + ":/usr/sbin"
        full_env.update(env or {})
        if run_as and run_as.pythonpath:
            full_env["PYTHONPATH"] = os.pathsep.join(run_as.pythonpath)
        with self.log_path.open("a") as log:
            self._log_offset = self.log_path.stat().st_size
            log.write(f"--- daemon start at {time.time():.3f}\n")
        python = run_as.python if run_as else sys.executable
        log_file = self.log_path.open("a")
        try:
            self.proc = subprocess.Popen(
                [*through, python, "-m", "supervisor", "run", "--config", str(self.settings_path)],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=full_env,
                **({"user": run_as.uid, "group": run_as.gid, "extra_groups": list(run_as.groups)} if run_as else {}),
            )
        finally:
            log_file.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    async def wait_exit(self, timeout: float = 15) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon pid={self.proc.pid} still running after {timeout}s\n{self.log()}")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def kill9(self) -> None:
        """kill -9 the daemon only: HAProxy stays, as after an OOM kill."""
        self.remember_master()
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(5)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.remember_master()
            # SIGTERM first: the daemon stops (and reaps) HAProxy itself, faster than a kill.
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.remember_master()
        for pid in self.masters:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE and str(self.runtime / "master.sock") in " ".join(
                    proc.cmdline()
                ):
                    kill_tree(pid)

    def remember_master(self) -> int | None:
        pid = self.master_pid()
        if pid is not None:
            self.masters.add(pid)
        return pid

    def master_pid(self) -> int | None:
        try:
            return int((self.runtime / "haproxy.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------ logs

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def run_log(self) -> str:
        """The log of the latest start only."""
        return self.log()[self._log_offset :]

    def count(self, pattern: str, whole: bool = False) -> int:
        return len(re.findall(pattern, self.log() if whole else self.run_log(), re.M))

    async def wait_log(self, pattern: str, count: int = 1, timeout: float = 15, whole: bool = False) -> list[str]:
        """Wait until `pattern` (a regex) matched `count` lines; returns the matching lines."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log() if whole else self.run_log()
            lines = [m.group(0) for m in re.finditer(f"^.*(?:{pattern}).*$", text, re.M)]
            if len(lines) >= count:
                return lines
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}) before logging {pattern!r}:\n{text}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {count} x {pattern!r} in the daemon log after {timeout}s:\n{text}")
            await asyncio.sleep(0.05)

    async def wait_generation(self, number: int, timeout: float = 15) -> int:
        """Wait for `reload ok generation=N` (or a master start with that generation); returns the worker PID."""
        lines = await self.wait_log(
            rf"(reload ok|generation started) generation={number} worker=\d+", timeout=timeout, whole=True
        )
        m = re.search(r"worker=(\d+)", lines[-1])
        assert m
        return int(m[1])

    async def healthz_seconds(self, stuck_after: float = 5.0) -> float:
        """Time one GET /healthz on the status socket; fail the test when it is 200-less or
        has not answered after `stuck_after` seconds (the event loop is blocked)."""
        started = time.monotonic()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(self.directory / "status.sock")), stuck_after
            )
            try:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n")
                answer = await asyncio.wait_for(reader.read(), stuck_after)
            finally:
                writer.close()
        except TimeoutError:
            raise AssertionError(f"/healthz did not answer within {stuck_after}s") from None
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        return time.monotonic() - started

    # ------------------------------------------------------------ haproxy

    async def show_proc(self) -> ProcList:
        return await self.cli.show_proc()

    def write(self, text: str) -> None:
        write_atomic(self.rendered, text)


@contextlib.contextmanager
def daemons(directory: Path) -> Iterator[Callable[..., Daemon]]:
    made: list[Daemon] = []

    def make(rendered: str, settings: dict | None = None, name: str = "d") -> Daemon:
        d = Daemon(directory / name, rendered, settings)
        made.append(d)
        return d

    try:
        yield make
    finally:
        for d in made:
            d.cleanup()


# ---------------------------------------------------------------- a daemon in front of one backend


@dataclass
class Node:
    daemon: Daemon
    front: int  # HAProxy's frontend port
    backend: str  # the one backend server's address
    worker: int  # generation 1's worker
    loop: RequestLoop | None = None  # requests through HAProxy, once started
    honesty: Any = None  # tests/support/faults.Honesty, when sampled

    def write(self, tag: str, edit: Callable[[str], str] = lambda text: text) -> None:
        """Render the config that stamps `tag` on responses (through `edit`)."""
        self.daemon.write(edit(tagged_config(self.front, self.backend, tag)))

    def requests(self, max_requests: int, max_seconds: float) -> RequestLoop:
        """Start a bounded request loop through HAProxy (the test stops it)."""
        self.loop = RequestLoop(self.front, max_requests=max_requests, max_seconds=max_seconds).start()
        return self.loop

    def tags(self) -> list[str]:
        assert self.loop is not None
        return [tag for _, tag in self.loop.results]


@contextlib.asynccontextmanager
async def one_backend(
    make: Callable[..., Daemon], settings: dict | None = None, tag: str = "v1"
) -> AsyncIterator[Node]:
    """A backend (b1) and a daemon on the config that stamps `tag`, started, with its first
    generation's worker serving; the backend is stopped on the way out."""
    front = free_port()
    with backends("b1") as started:
        address = started["b1"].address
        d = make(tagged_config(front, address, tag), settings)
        d.start()
        yield Node(d, front, address, await d.wait_generation(1))
