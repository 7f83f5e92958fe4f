"""The CLI's language: names checked before they go on a line, `ServerKey`, and one parser per
answer of the master CLI (tested on tests/captured/); `split_answers` cuts a `;` line's text."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

# Names that reach the CLI must not be able to smuggle a second command or argument.
_SAFE_NAME = re.compile(r"\A[A-Za-z0-9_.:\-]+\Z")  # \Z: "$" would let a trailing newline through


# The hand-off's server (handoff.py), never one the daemon reports or decides on: named here,
# below both readers of servers, the config's (resolution.py) and servers_state_rows.
HANDOFF_SERVER = "_hs_current"


def validate_name(kind: str, name: str) -> str:
    """A backend, server, map key or value that may go on a CLI line, or ValueError."""
    if not _SAFE_NAME.match(name):
        raise ValueError(f"invalid {kind} name {name!r}: only letters, digits and _ . : - are allowed")
    return name


class ServerKey(str):
    """`<backend>/<server>`, the key of every server map and set. of() takes names HAProxy holds;
    checked() and parse() take names bound for the CLI, and raise ValueError for unsafe ones."""

    __slots__ = ()

    @classmethod
    def of(cls, backend: str, server: str) -> ServerKey:
        return cls(f"{backend}/{server}")

    @classmethod
    def checked(cls, backend: str, server: str) -> ServerKey:
        return cls(f"{validate_name('backend', backend)}/{validate_name('server', server)}")

    @classmethod
    def parse(cls, text: str) -> ServerKey:
        backend, sep, server = text.partition("/")
        if not sep:
            raise ValueError(f"invalid server key {text!r}: expected backend/server")
        return cls.checked(backend, server)

    @property
    def backend(self) -> str:
        return self.partition("/")[0]

    @property
    def server(self) -> str:
        return self.partition("/")[2]


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    kind: str  # master | worker | program name
    reloads: int  # for a worker: how many reloads ago it was started


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


_PROC_LINE = re.compile(r"^(\d+)\s+(\S+)\s+(\d+)(?:\s+\[failed:\s*(\d+)\])?\s+\S+")  # then uptime, version


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
            section = {"workers": "workers", "old workers": "old"}.get(heading, "other")
            continue
        m = _PROC_LINE.match(stripped)
        if not m:
            continue
        proc = Proc(int(m[1]), m[2], int(m[3]))
        if proc.kind == "master":
            master = proc
            failed = int(m[4] or 0)
        elif proc.kind == "worker" and section in ("workers", "old"):
            (workers if section == "workers" else old).append(proc)
    if not workers and old:
        # From 3.1 on every worker started before the master's last re-exec is listed as old,
        # stopping or not: with `# workers` empty (a failed reload, or before the fork) the
        # youngest still serves, and is the current worker.
        youngest = min(p.reloads for p in old)
        workers = [p for p in old if p.reloads == youngest]
        old = [p for p in old if p.reloads != youngest]
    return ProcList(master, failed, tuple(workers), tuple(old))


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


def show_info_by_pid(text: str) -> dict[int, dict[str, str]]:
    """`show info` answers (several workers' on one line) by `Pid`; one without is left out."""
    blocks: list[dict[str, str]] = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            key = key.strip()
            if not blocks or (key == "Name" and blocks[-1]):
                blocks.append({})
            blocks[-1][key] = value.strip()
    return {int(block["Pid"]): block for block in blocks if block.get("Pid", "").isdigit()}


# Format version 1: a version line, then per process a `# be_id ...` header, then a row per server.
_STATE_HEADER = "# be_id"
ROW_TEXT = "row text"  # a column name for servers_state_rows(): the row as HAProxy wrote it


def is_servers_state(text: str) -> bool:
    """Whether `text` is a `show servers state` answer (not an error), servers or none."""
    first = text.lstrip().split("\n", 1)[0].strip()
    return first.isdigit() and _STATE_HEADER in text


@dataclass(frozen=True, slots=True)
class StateRows:
    """The rows under one `# be_id` header; `at`: where each wanted column it has is."""

    header: str  # the header line, as written
    at: dict[str, int]
    rows: list[tuple[str, ...]]


def servers_state_rows(text: str, wanted: Collection[str]) -> Iterator[StateRows]:
    """The rows of a `show servers state` answer (or part), header by header: one regex pass (in
    C) over each block, so a big answer costs little more than its reader's loop."""
    start = text.find(_STATE_HEADER)
    while start != -1:
        end = text.find("\n", start)
        header = text[start : end if end != -1 else len(text)]
        columns = header[2:].split()
        fields = r"[ \t]+".join(_column_pattern(c, c in wanted) for c in columns)
        whole = ROW_TEXT in wanted
        pattern = re.compile("^(" + fields + r"[ \t]*)$" if whole else "^" + fields + r"[ \t]*$", re.M)
        picked = [c for c in columns if c in wanted]
        at = {name: i + whole for i, name in enumerate(picked)}
        if whole:
            at[ROW_TEXT] = 0
        following = text.find(_STATE_HEADER, start + 1)
        block = text[end + 1 : following if following != -1 else len(text)] if end != -1 else ""
        found = pattern.findall(block)
        rows = found if pattern.groups > 1 else [(value,) for value in found]
        yield StateRows(header, at, rows)
        start = following


def _column_pattern(column: str, wanted: bool) -> str:
    """A column's field in a row; a row naming the hand-off's server matches no pattern."""
    field = r"(\S+)" if wanted else r"\S+"
    return rf"(?!{HANDOFF_SERVER}(?:[ \t]|$)){field}" if column == "srv_name" else field


def servers_state_parts(text: str, rows: int) -> Iterator[str]:
    """`show servers state` in parts of at most `rows` rows, each under its header."""
    start = text.find(_STATE_HEADER)
    while start != -1:
        end = text.find("\n", start)
        if end == -1:
            return
        header = text[start : end + 1]
        following = text.find(_STATE_HEADER, end)
        lines = text[end + 1 : following if following != -1 else len(text)].split("\n")
        for i in range(0, len(lines), rows):
            yield header + "\n".join(lines[i : i + rows])
        start = following


# srv_admin_state bits: 0x01 forced maint, 0x02 inherited, 0x04 config `disabled` (not maint:
# `state ready` leaves it on a server that serves, 2.6.12), 0x08/0x10 drain, 0x20 DNS maint.
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
    def key(self) -> ServerKey:
        return ServerKey.of(self.backend, self.name)

    @property
    def in_maint(self) -> bool:
        return bool(self.admin_state & ADMIN_MAINT_MASK)


_STATE_COLUMNS = ("be_name", "srv_name", "srv_addr", "srv_port", "srv_op_state", "srv_admin_state", "srv_uweight")


def parse_servers_state(text: str) -> list[ServerState]:
    """Every server of a `show servers state` answer, one or many answers concatenated."""
    states: list[ServerState] = []
    for block in servers_state_rows(text, _STATE_COLUMNS):
        at = block.at
        i_be, i_name, i_addr, i_op = at["be_name"], at["srv_name"], at["srv_addr"], at["srv_op_state"]
        i_admin, i_weight, i_port = at["srv_admin_state"], at["srv_uweight"], at.get("srv_port")
        for v in block.rows:
            port = v[i_port] if i_port is not None else ""
            port_number = int(port) if port.isdigit() else None
            states.append(ServerState(v[i_be], v[i_name], v[i_addr], port_number, int(v[i_op]), int(v[i_admin]),
                                      int(v[i_weight])))
    return states


def parse_show_map(text: str) -> list[tuple[str, str]]:
    """`show map <file>`: (key, value) of its lines `<ref> <key> <value>`."""
    entries: list[tuple[str, str]] = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0].startswith("0x"):
            entries.append((parts[1], parts[2]))
    return entries


def parse_prepare_map(text: str) -> int | None:
    """`prepare map <file>`: the version it created, or None (the answer is an error)."""
    m = re.search(r"New version created: (\d+)", text)
    return int(m[1]) if m else None


@dataclass(frozen=True, slots=True)
class Stream:
    """A stream of `show sess`; `back_state`: enum sc_state in 2.6, a name in some later versions."""

    id: str
    frontend: str
    server: ServerKey
    back_state: str


_SESS_LINE = re.compile(r"^(0x[0-9a-fA-F]+):.*?\sfe=(\S+)\s+be=(\S+)\s+srv=(\S+)\s.*?\sscb=\[(\w+),", re.M)


def parse_show_sess(text: str) -> list[Stream]:
    """`show sess`: a line per stream, `... fe=<frontend> be=<backend> srv=<server> ... scb=[<state>,...`."""
    return [Stream(m[1], m[2], ServerKey.of(m[3], m[4]), m[5]) for m in _SESS_LINE.finditer(text)]


# What a command prints through the master CLI (tests/captured/answers_*.txt). SILENT: nothing
# when it took, else one line; then an empty line. ONE_LINE (`add|del server`, `set server ...
# addr`): a line, then an empty one on 2.8+, not always on 2.6. LISTING (`show ...`): lines up to
# an empty one. MASTER_MODE (`experimental-mode on`): nothing.
SILENT, ONE_LINE, LISTING, MASTER_MODE = "silent", "one line", "listing", "master mode"
_MASTER_MODES = ("experimental-mode", "expert-mode", "mcli-debug-mode")


def answer_shape(command: str) -> str:
    """What `command` (`@!<pid>` prefix or not) prints."""
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
    """One answer per command of a `;` line; None when the text cannot be read as their answers
    (a master-level error ends a line early), or reads two ways."""
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
