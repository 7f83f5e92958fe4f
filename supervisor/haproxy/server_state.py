"""Server state across reloads: `show servers state` saved to the `server-state-file` the new
worker loads, so a server in maint or DOWN does not start UP. HAProxy applies it by rules that do
not fit a changing config (the saved port wins), so a line is kept only when address, port,
`disabled` and weight agree in both configs: what carries over is what no config says
(docs/runtime-changes.md)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Collection, Iterator
from pathlib import Path

from ..files import write_atomically
from .answers import ROW_TEXT, ServerKey, is_servers_state, servers_state_parts, servers_state_rows
from .api import CLIError, MasterCLI
from .config import Config, Section
from .lexer import Line, parse_line, quote_word
from .resolution import PROXY_KINDS, Server, is_ip, same_host
from .routing import effective_weight

log = logging.getLogger(__name__)

# A state file with no server: HAProxy warns of an empty or missing one at every start.
EMPTY_STATE = "1\n"
ROWS_PER_PART = 2000  # filtered between two turns of the event loop


def _config_identity(server: Server) -> tuple[str, int | None, bool, int]:
    return server.address, server.port, server.disabled, effective_weight(server)


def _carries_over(
    key: str, address: str, port: str, running: dict[str, Server], new: dict[str, Server], forget: Collection[str]
) -> bool:
    before, after = running.get(key), new.get(key)
    if key in forget or before is None or after is None:
        return False
    if before is not after and _config_identity(before) != _config_identity(after):
        return False
    if port != str(after.port if after.port is not None else 0):
        return False
    if is_ip(after.address):
        return same_host(address, after.address)
    return True  # a host name: the file holds what it resolved to


def server_state_parts(text: str, running: Config, new: Config, forget: Collection[str] = ()) -> Iterator[str]:
    """The filtered state file (module doc) in parts of ROWS_PER_PART rows, the first two empty
    (after each config's servers are listed): the event loop runs between parts."""
    if not is_servers_state(text):
        yield EMPTY_STATE
        return
    running_servers = running.server_map()
    yield ""
    new_servers = new.server_map()
    yield ""
    out = [next(line for line in text.splitlines() if line.strip())]  # the format's version
    header = ""
    forget = frozenset(forget)
    for part in servers_state_parts(text, ROWS_PER_PART):
        for block in servers_state_rows(part, _ROW_COLUMNS):
            if block.header != header:
                header = block.header
                out.append(header)
            i_row, i_be, i_name, i_addr, i_port = (block.at.get(name, -1) for name in _ROW_COLUMNS)
            for row in block.rows:
                key = ServerKey.of(row[i_be], row[i_name])
                port = row[i_port] if i_port >= 0 else ""
                if _carries_over(key, row[i_addr], port, running_servers, new_servers, forget):
                    out.append(row[i_row])
        yield "\n".join(out) + "\n" if out else ""
        out = []


_ROW_COLUMNS = (ROW_TEXT, "be_name", "srv_name", "srv_addr", "srv_port")


def _append_line(section: Section, words: str) -> None:
    """Add a line after the section's last code line, indented and ended like it."""
    code = [i for i, line in enumerate(section.body) if line.words]
    neighbour: Line | None = section.body[code[-1]] if code else section.header
    indent = (neighbour.indent if code and neighbour is not None else "") or "    "
    ended = [line for line in (neighbour, section.header) if line is not None and line.raw.endswith("\n")]
    ending = "\r\n" if ended and ended[0].raw.endswith("\r\n") else "\n"
    if neighbour is not None and not neighbour.raw.endswith("\n"):
        # The last line of a file without a final newline must not swallow the new one.
        fixed = parse_line(neighbour.raw + ending)
        if code:
            section.body[code[-1]] = fixed
        else:
            section.header = fixed
    section.body.insert(code[-1] + 1 if code else 0, parse_line(f"{indent}{words}{ending}"))


def _loads_server_state(config: Config) -> bool:
    # Plain loops: this reads every line, where a generator and Line.keyword cost more.
    for section in config.sections:
        if section.kind in PROXY_KINDS:
            for line in section.body:
                words = line.words
                if words and words[0] == "load-server-state-from-file":
                    return True
    return False


def inject_server_state(config: Config, path: Path) -> Config:
    """`server-state-file` in global and `load-server-state-from-file global` in every defaults
    (and backends without one), each unless the rendered config uses that keyword itself."""
    result = config.copy()
    if result.global_setting("server-state-file") is None:
        global_section = next((s for s in result.sections if s.kind == "global"), None)
        if global_section is None:
            global_section = Section(parse_line("global\n"))
            result.sections.insert(1, global_section)
        _append_line(global_section, f"server-state-file {quote_word(str(path))}")
    if not _loads_server_state(result):
        # A backend after any defaults, or naming one with `from`, inherits the line.
        seen_defaults = False
        for section in result.sections:
            seen_defaults = seen_defaults or section.kind == "defaults"
            if section.kind == "defaults" or (
                section.kind in ("backend", "listen") and not seen_defaults and section.from_defaults is None
            ):
                _append_line(section, "load-server-state-from-file global")
    return result


def clear_server_state(path: Path) -> str | None:
    """A master started afresh must not load a previous run's state. On a full disk the file is
    emptied in place, else removed (HAProxy warns). What failed, or None."""
    try:
        write_atomically(path, EMPTY_STATE)
        return None
    except OSError as exc:
        error = f"{exc.filename or path}: {exc.strerror or exc}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, EMPTY_STATE.encode())
        finally:
            os.close(fd)
        return f"{error}; emptied it in place"
    except OSError:
        pass
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        return f"{error}; and cannot remove it: {exc.strerror or exc}"
    return f"{error}; removed it"


async def save_server_state(
    cli: MasterCLI, worker_pid: int, path: Path, *, running: Config, new: Config, forget: Collection[str] = ()
) -> bool:
    """Save the worker's server state for the reload to `new`; on failure empty the file (an older
    state is no longer true) and return False."""
    try:
        answer = await cli.on(worker_pid, "show servers state")
        why = None if is_servers_state(answer) else f"unexpected answer {answer.strip()[:120]!r}"
    except CLIError as exc:
        why = str(exc)
    if why is not None:
        log.warning("cannot save server state of worker %d: %s; the new worker starts from its config", worker_pid, why)
        write_atomically(path, EMPTY_STATE)
        return False
    parts = []
    for part in server_state_parts(answer, running, new, forget):
        parts.append(part)
        await asyncio.sleep(0)  # the event loop runs between parts
    write_atomically(path, "".join(parts))
    return True
