"""Async client for HAProxy's master CLI, and parsers for what it answers.

The master CLI answers one command line per connection: we write the line,
half-close, and read until HAProxy closes. A line may carry several commands
separated by `;`, each with its own `@!<pid>` prefix to reach a worker (old
ones included). Parsers are pure functions over the answer text, so they are
unit-tested on captured answers of 2.6 and 3.x.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# HAProxy accepts 10 master-CLI connections at once; leave room for an operator's socat.
MAX_CONNECTIONS = 8
# A command line must fit in tune.bufsize (16384 by default), with room for the newline.
DEFAULT_LINE_LIMIT = 16000

# Names that reach the CLI must not be able to smuggle a second command or argument.
_SAFE_NAME = re.compile(r"\A[A-Za-z0-9_.:\-]+\Z")  # \Z: "$" would let a trailing newline through


class CLIError(Exception):
    """The master CLI could not be reached or did not answer in time."""


def validate_name(kind: str, name: str) -> str:
    """A backend, server, map key or value that may go on a CLI line, or ValueError."""
    if not _SAFE_NAME.match(name):
        raise ValueError(f"invalid {kind} name {name!r}: only letters, digits and _ . : - are allowed")
    return name


def on_process(pid: int, command: str) -> str:
    """Route a command to one process through the master: `@!<pid> <command>`."""
    return f"@!{int(pid)} {command}"


def batch_lines(commands: Iterable[str], limit: int = DEFAULT_LINE_LIMIT) -> list[str]:
    """Join commands with `;` into as few lines as fit in `limit` bytes each."""
    lines: list[str] = []
    current: list[str] = []
    size = 0
    for command in commands:
        if "\n" in command or ";" in command:
            raise ValueError(f"command would split into several: {command!r}")
        cost = len(command.encode()) + (1 if current else 0)
        if current and size + cost > limit:
            lines.append(";".join(current))
            current, size = [], 0
            cost = len(command.encode())
        if cost > limit:
            raise ValueError(f"command longer than the CLI line limit ({limit} bytes): {command[:60]}...")
        current.append(command)
        size += cost
    if current:
        lines.append(";".join(current))
    return lines


class MasterCLI:
    """The master socket. Every call opens its own connection, bounded by a semaphore."""

    def __init__(self, path: Path | str, timeout: float = 5.0, connections: int = MAX_CONNECTIONS):
        self.path = str(path)
        self.timeout = timeout
        self._slots = asyncio.Semaphore(connections)

    async def execute(self, line: str, timeout: float | None = None) -> str:
        """Send one command line and return the whole answer."""
        async with self._slots:
            try:
                # asyncio.timeout, not wait_for: no extra task per line (a drain sends hundreds).
                async with asyncio.timeout(timeout or self.timeout):
                    return await self._roundtrip(line)
            except (TimeoutError, OSError, EOFError) as exc:
                kind = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc) or type(exc).__name__
                raise CLIError(f"master CLI {self.path}: {line.split(' ', 2)[:2]}: {kind}") from None

    async def _connect(self) -> socket.socket:
        # The master re-executes itself on reload and its socket refuses connections for a
        # few milliseconds; that is not an error worth reporting.
        loop = asyncio.get_running_loop()
        for attempt in range(50):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, self.path)
                return sock
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                if attempt == 49:
                    raise
                await asyncio.sleep(0.02)
            except BaseException:
                sock.close()
                raise
        raise AssertionError("unreachable")

    async def _roundtrip(self, line: str) -> str:
        # Plain non-blocking socket calls, not asyncio streams: a drain sends a line per old
        # worker, and a transport, a protocol and two stream objects per line cost more CPU
        # than the line itself (measured in the commit that made this choice).
        loop = asyncio.get_running_loop()
        sock = await self._connect()
        try:
            await loop.sock_sendall(sock, line.encode() + b"\n")
            # The master CLI only answers once it sees the end of input.
            sock.shutdown(socket.SHUT_WR)
            chunks: list[bytes] = []
            while chunk := await loop.sock_recv(sock, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
        finally:
            sock.close()

    async def execute_many(self, commands: Sequence[str], limit: int = DEFAULT_LINE_LIMIT) -> list[str]:
        """Send commands batched into lines, lines in parallel; answers per line, in order."""
        lines = batch_lines(commands, limit)
        return list(await asyncio.gather(*(self.execute(line) for line in lines)))

    async def show_proc(self) -> ProcList:
        return parse_show_proc(await self.execute("show proc"))

    async def reload(self) -> ReloadAnswer:
        return parse_reload(await self.execute("reload", timeout=max(self.timeout, 30.0)))

    async def on(self, pid: int, command: str, timeout: float | None = None) -> str:
        return await self.execute(on_process(pid, command), timeout)


# ---------------------------------------------------------------- answers of a `;` line

# What a command prints, as the master CLI relays it (tests/captured/answers_*.txt, from each
# supported binary):
# - SILENT: nothing when it took, else one line; then an empty line, on every version
#   (`set server ... state|weight`, `enable health|agent`, `shutdown sessions server`,
#   `add|set|del map`).
# - ONE_LINE: always one line, then an empty line or not: 2.6 ends no `del server` answer and
#   no `add server` refusal with one, 2.8 and later end every answer with one (`add server`,
#   `del server`, `set server ... addr`).
# - LISTING: lines up to an empty one (`show ...`).
# - MASTER_MODE: the master's own mode commands print nothing at all (`experimental-mode on`).
SILENT, ONE_LINE, LISTING, MASTER_MODE = "silent", "one line", "listing", "master mode"
_MASTER_MODES = ("experimental-mode", "expert-mode", "mcli-debug-mode")


def answer_shape(command: str) -> str:
    """What `command` (as it goes on the line, `@!<pid>` prefix or not) prints (see above)."""
    words = command.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    elif words and words[0] in _MASTER_MODES:
        return MASTER_MODE
    if words[:1] == ["show"]:
        return LISTING
    if words[:2] in (["add", "server"], ["del", "server"]):
        return ONE_LINE
    if words[:2] == ["set", "server"] and words[3:4] == ["addr"]:
        return ONE_LINE
    return SILENT


def _readings(shape: str, lines: list[str], at: int) -> list[tuple[int, str]]:
    """Where one command's answer may end, from line `at`, and its text: (next line, text)."""
    end = len(lines)
    if shape == MASTER_MODE:
        return [(at, "")]
    if at >= end:
        return []
    if shape == LISTING:
        stop = next((i for i in range(at, end) if lines[i] == ""), end)
        return [(min(stop + 1, end), "\n".join(lines[at:stop]))]
    if shape == SILENT:
        if lines[at] == "":
            return [(at + 1, "")]
        if at + 1 < end and lines[at + 1] == "":
            return [(at + 2, lines[at])]
        return [(at + 1, lines[at])] if at + 1 == end else []  # the last line, cut short
    if lines[at] == "":
        return []
    readings = [(at + 1, lines[at])]
    if at + 1 < end and lines[at + 1] == "":
        readings.append((at + 2, lines[at]))
    return readings


def split_answers(text: str, commands: Sequence[str]) -> list[str] | None:
    """One answer per command of a `;` line, read by what each command prints; None when
    the text cannot be read as their answers, or can be read two ways.

    A master-level error (`Can't find the target PID`) ends the line early, so the text no
    longer reads as the commands' answers.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    # Every way to read the text so far, by the line it reached: how many ways (capped at 2),
    # and the line the last answer began at with its text, to walk back from the end.
    ways: dict[int, int] = {0: 1}
    steps: list[dict[int, tuple[int, str]]] = []
    for command in commands:
        shape = answer_shape(command)
        following: dict[int, int] = {}
        back: dict[int, tuple[int, str]] = {}
        for at, count in ways.items():
            for reached, answer in _readings(shape, lines, at):
                following[reached] = min(2, following.get(reached, 0) + count)
                back.setdefault(reached, (at, answer))
        if not following:
            return None
        ways = following
        steps.append(back)
    if ways.get(len(lines)) != 1:
        return None
    answers: list[str] = []
    at = len(lines)
    for back in reversed(steps):
        at, answer = back[at]
        answers.append(answer)
    answers.reverse()
    return answers


# ---------------------------------------------------------------- show proc


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    kind: str  # master | worker | program name
    reloads: int  # for a worker: how many reloads ago it was started
    uptime: str
    version: str


@dataclass(frozen=True, slots=True)
class ProcList:
    master: Proc | None
    master_failed: int  # the master's `[failed: N]` counter
    workers: tuple[Proc, ...]  # current worker(s)
    old_workers: tuple[Proc, ...]

    @property
    def current_worker(self) -> Proc | None:
        # With nbproc gone there is one current worker; the youngest if ever several.
        return min(self.workers, key=lambda p: p.reloads) if self.workers else None


_PROC_LINE = re.compile(r"^(\d+)\s+(\S+)\s+(\d+)(?:\s+\[failed:\s*(\d+)\])?\s+(\S+)\s*(\S*)")


def parse_show_proc(text: str) -> ProcList:
    """Parse `show proc` of 2.6 to 3.x (`# programs` present or not, `# old workers` only when any)."""
    master: Proc | None = None
    failed = 0
    workers: list[Proc] = []
    old: list[Proc] = []
    section = "master"
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            heading = stripped.lstrip("#").strip().lower()
            if heading.startswith("<pid>") or not heading:
                continue
            section = {"workers": "workers", "old workers": "old", "programs": "programs"}.get(
                heading, "other"
            )
            continue
        m = _PROC_LINE.match(stripped)
        if not m:
            continue
        proc = Proc(int(m[1]), m[2], int(m[3]), m[5], m[6])
        if proc.kind == "master":
            master = proc
            failed = int(m[4] or 0)
        elif section == "workers" and proc.kind == "worker":
            workers.append(proc)
        elif section == "old" and proc.kind == "worker":
            old.append(proc)
    if not workers and old:
        # From 3.1 on the master lists as old every worker started before its last re-exec
        # (reloads > 0), stopping or not. After a reload that failed, or before the new worker
        # is forked, `# workers` is empty and the youngest of them still serves (`show info`:
        # Stopping: 0): it is the current worker, never one to steer as old.
        youngest = min(p.reloads for p in old)
        workers = [p for p in old if p.reloads == youngest]
        old = [p for p in old if p.reloads != youngest]
    return ProcList(master, failed, tuple(workers), tuple(old))


# ---------------------------------------------------------------- reload


@dataclass(frozen=True, slots=True)
class ReloadAnswer:
    success: bool | None  # None: 2.6 says nothing, confirm with show proc
    log: str


def parse_reload(text: str) -> ReloadAnswer:
    """2.6 answers nothing; 2.7+ answers `Success=1|0`, a `--` line, then the startup log."""
    stripped = text.strip()
    if not stripped:
        return ReloadAnswer(None, "")
    head, _, log = stripped.partition("\n--")
    m = re.search(r"Success=(\d)", head)
    if not m:
        return ReloadAnswer(None, stripped)
    return ReloadAnswer(m[1] == "1", log.lstrip("-\n"))


# ---------------------------------------------------------------- show info / servers state / map


def parse_show_info(text: str) -> dict[str, str]:
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return info


# srv_op_state: 0 = stopped (DOWN), 1 = starting, 2 = running, 3 = stopping.
# srv_admin_state is a bit field: 0x01 forced maint, 0x02 inherited maint, 0x04 "config said
# `disabled`", 0x08 forced drain, 0x10 inherited drain, 0x20 maint from DNS resolution.
# 0x04 alone is not maint: a `disabled` server starts at 0x05 and `set server ... state
# ready` leaves 0x04 on a server that serves (seen on 2.6.12), so it stays out of the mask.
ADMIN_MAINT_MASK = 0x01 | 0x02 | 0x20


@dataclass(frozen=True, slots=True)
class ServerState:
    backend: str
    name: str
    address: str
    port: int | None
    op_state: int
    admin_state: int
    weight: int

    @property
    def key(self) -> str:
        return f"{self.backend}/{self.name}"

    @property
    def in_maint(self) -> bool:
        return bool(self.admin_state & ADMIN_MAINT_MASK)

    @property
    def down(self) -> bool:
        return self.op_state == 0

    @property
    def alive(self) -> bool:
        return not self.down and not self.in_maint


def parse_servers_state(text: str) -> list[ServerState]:
    """Parse `show servers state` (format version 1), one or many answers concatenated."""
    states: list[ServerState] = []
    columns: list[str] = []
    for line in text.splitlines():
        if line.startswith("# be_id"):
            columns = line[2:].split()
            continue
        if not line or line.startswith("#") or not columns:
            continue
        values = line.split()
        if len(values) < len(columns):
            continue
        row = dict(zip(columns, values, strict=False))
        port = row.get("srv_port", "")
        states.append(
            ServerState(
                backend=row["be_name"],
                name=row["srv_name"],
                address=row["srv_addr"],
                port=int(port) if port.isdigit() else None,
                op_state=int(row["srv_op_state"]),
                admin_state=int(row["srv_admin_state"]),
                weight=int(row["srv_uweight"]),
            )
        )
    return states


def parse_show_map(text: str) -> list[tuple[str, str]]:
    """`show map <file>` lines are `<ref> <key> <value>`; the answer is (key, value) pairs."""
    entries: list[tuple[str, str]] = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0].startswith("0x"):
            entries.append((parts[1], parts[2]))
    return entries
