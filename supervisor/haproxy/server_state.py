"""Server state across reloads: what the current worker knows, handed to the next one.

Before a reload the current worker's `show servers state` is saved to the file the
effective config names in `server-state-file`; the new worker loads it at start-up
(`load-server-state-from-file global`), so a server in maint, or DOWN by its health
checks, does not start UP in the new worker.

HAProxy 2.6 applies that file with rules that do not fit a config that changes
(checked with the real binary, see tests/test_runtime_across_reloads_e2e.py):

- `srv_port` from the file always overrides the port in the new config, so a server
  moved to another port would keep the old one. (The address of a server written as an
  IP literal comes from the config.)
- The admin state is restored whenever the config's `disabled` did not flip between the
  old worker's config and the new one. The old worker's config is not what we last set:
  a slot disabled at runtime by this daemon (forced maint) and enabled again in the next
  config would stay in maint, and a slot enabled at runtime and disabled again would
  come back ready.

So the saved file is filtered: a server's line is kept only when the server exists in
both the running effective config and the new one with the same address, port,
`disabled` and weight, and the file's address and port are the ones the new config
gives it. Everything else starts from the new config. What carries over is exactly the
state no config expresses: health (DOWN), a maint or drain set by an operator, an
operator's weight.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from collections.abc import Collection, Iterator
from pathlib import Path

from ..files import write_atomically
from .answers import ROW_TEXT, ServerKey, is_servers_state, servers_state_parts, servers_state_rows
from .api import CLIError, MasterCLI
from .config import Config, Section
from .lexer import Line, parse_line, quote_word
from .resolution import PROXY_KINDS, Server, is_ip

log = logging.getLogger(__name__)

# A state file with no server: HAProxy loads it without a warning (an empty or missing
# file makes every start log one).
EMPTY_STATE = "1\n"


def _same_ip(a: str, b: str) -> bool:
    if a == b:
        return True  # the usual case, without parsing either
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False


def _config_identity(server: Server) -> tuple[str, int | None, bool, int]:
    return server.address, server.port, server.disabled, 1 if server.weight is None else server.weight


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
        return _same_ip(address, after.address)
    return True  # a host name: the file holds what it resolved to


def server_state_parts(
    text: str, running: Config, new: Config, forget: Collection[str] = (), rows_per_part: int = 2000
) -> Iterator[str]:
    """filter_server_state() in parts of `rows_per_part` rows (their concatenation is its
    answer; the first two are empty, after each config's servers are listed): a caller on
    the event loop lets it run between parts."""
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
    for part in servers_state_parts(text, rows_per_part):
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
    """Add a line after the section's last code line, indented and ended like its neighbours."""
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
    # Plain loops over every line of 10,000 servers: a generator and Line.keyword cost twice as much.
    for section in config.sections:
        if section.kind in PROXY_KINDS:
            for line in section.body:
                words = line.words
                if words and words[0] == "load-server-state-from-file":
                    return True
    return False


def inject_server_state(config: Config, path: Path) -> Config:
    """Make the worker load the server state saved before a reload, unless the config already does.

    `server-state-file <path>` goes into global, `load-server-state-from-file global`
    into every defaults section (and into backends that have no defaults to inherit
    from). Each is left out when the rendered config already uses that keyword:
    then it manages server state itself.
    """
    result = config.copy()
    if result.global_setting("server-state-file") is None:
        global_section = next((s for s in result.sections if s.kind == "global"), None)
        if global_section is None:
            global_section = Section(parse_line("global\n"))
            result.sections.insert(1, global_section)
        _append_line(global_section, f"server-state-file {quote_word(str(path))}")
    if not _loads_server_state(result):
        # One pass: a backend inherits from some defaults once any defaults section preceded it
        # (or it names one with `from`); only those that do not need the line of their own.
        seen_defaults = False
        for section in result.sections:
            seen_defaults = seen_defaults or section.kind == "defaults"
            if section.kind == "defaults" or (
                section.kind in ("backend", "listen") and not seen_defaults and section.from_defaults is None
            ):
                _append_line(section, "load-server-state-from-file global")
    return result


def clear_server_state(path: Path) -> str | None:
    """No state to hand over: a master started afresh must not load a previous run's file.
    Best-effort: when there is no room for the new file an atomic write makes (a full disk),
    the old one is emptied in place (its truncated block holds the few bytes), else removed
    (HAProxy starts without it, with a warning). Returns what failed, or None."""
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
    cli: MasterCLI,
    worker_pid: int,
    path: Path,
    *,
    running: Config,
    new: Config,
    forget: Collection[str] = (),
) -> bool:
    """Save the worker's server state for the reload to `new`; False (and no state) on failure.

    On failure the file is emptied rather than left alone: a state file from an earlier
    reload would hand the new worker states that are no longer true.
    """
    try:
        answer = await cli.on(worker_pid, "show servers state")
    except CLIError as exc:
        log.warning("cannot save server state of worker %d: %s; the new worker starts from its config", worker_pid, exc)
        write_atomically(path, EMPTY_STATE)
        return False
    if not is_servers_state(answer):
        log.warning(
            "cannot save server state of worker %d: unexpected answer %r; the new worker starts from its config",
            worker_pid,
            answer.strip()[:120],
        )
        write_atomically(path, EMPTY_STATE)
        return False
    parts = []
    for part in server_state_parts(answer, running, new, forget):
        parts.append(part)
        await asyncio.sleep(0)  # a 10,000-server state is filtered in parts: the event loop runs between
    write_atomically(path, "".join(parts))
    return True
