"""Server state across reloads: what the current worker knows, handed to the next one.

Before a reload the current worker's `show servers state` is saved to the file the
effective config names in `server-state-file`; the new worker loads it at start-up
(`load-server-state-from-file global`), so a server in maint, or DOWN by its health
checks, does not start UP in the new worker.

HAProxy 2.6 applies that file with rules that do not fit a config that changes
(checked with the real binary, see tests/test_runtime_e2e.py):

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
from collections.abc import Collection, Iterator
from pathlib import Path

from ..files import write_atomically
from .api import CLIError, MasterCLI
from .config import Config, Server, is_ip

log = logging.getLogger(__name__)

# A state file with no server: HAProxy loads it without a warning (an empty or missing
# file makes every start log one).
EMPTY_STATE = "1\n"


def server_state_target(config: Config) -> Path | None:
    """The file the worker of `config` loads its server state from, when it can be known.

    The global `server-state-file`: absolute, or relative to an absolute
    `server-state-base`. A relative path without a base resolves against HAProxy's
    working directory, which is not ours to guess: None.
    """
    line = config.global_setting("server-state-file")
    if line is None or len(line.words) < 2:
        return None
    path = Path(line.words[1])
    if path.is_absolute():
        return path
    base = config.global_setting("server-state-base")
    if base is not None and len(base.words) >= 2 and Path(base.words[1]).is_absolute():
        return Path(base.words[1]) / path
    return None


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


def filter_server_state(text: str, running: Config, new: Config, forget: Collection[str] = ()) -> str:
    """The saved `show servers state`, keeping only what the new worker should inherit."""
    return "".join(server_state_parts(text, running, new, forget))


def server_state_parts(
    text: str, running: Config, new: Config, forget: Collection[str] = (), rows_per_part: int = 2000
) -> Iterator[str]:
    """filter_server_state() in parts of `rows_per_part` rows (their concatenation is its
    answer; the first two are empty, after each config's servers are listed): a caller on
    the event loop lets it run between parts."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].strip().isdigit():
        yield EMPTY_STATE
        return
    running_servers = running.server_map()
    yield ""
    new_servers = new.server_map()
    yield ""
    out = [lines[0]]
    columns: list[str] = []
    forget = frozenset(forget)
    for number, line in enumerate(lines[1:], 1):
        if number % rows_per_part == 0:
            yield "\n".join(out) + "\n" if out else ""
            out = []
        if line.startswith("# be_id"):
            columns = line[2:].split()
            out.append(line)
            at = {name: columns.index(name) if name in columns else len(columns) for name in _ROW_COLUMNS}
            i_be, i_name, i_addr, i_port = (at[name] for name in _ROW_COLUMNS)
            continue
        if line.startswith("#") or not columns:
            continue
        row = line.split()
        row.extend([""] * (len(columns) + 1 - len(row)))  # a short row: the missing columns are ""
        key = f"{row[i_be]}/{row[i_name]}"
        if _carries_over(key, row[i_addr], row[i_port], running_servers, new_servers, forget):
            out.append(line)
    if out:
        yield "\n".join(out) + "\n"


_ROW_COLUMNS = ("be_name", "srv_name", "srv_addr", "srv_port")


def clear_server_state(path: Path) -> None:
    """No state to hand over: a master started afresh must not load a previous run's file."""
    write_atomically(path, EMPTY_STATE)


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
    first = answer.lstrip().split("\n", 1)[0].strip()
    if not first.isdigit():
        log.warning(
            "cannot save server state of worker %d: unexpected answer %r; the new worker starts from its config",
            worker_pid,
            first[:120],
        )
        write_atomically(path, EMPTY_STATE)
        return False
    parts = []
    for part in server_state_parts(answer, running, new, forget):
        parts.append(part)
        await asyncio.sleep(0)  # a 10,000-server state is filtered in parts: the event loop runs between
    write_atomically(path, "".join(parts))
    return True
