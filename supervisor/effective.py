"""From the rendered config on disk to a validated effective config (rendered + injections),
which lives in runtime_dir; the rendered file is the controller's, never written to."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import errno
import hashlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from .files import DEFAULT_MAX_READ_BYTES, create_if_missing, ensure_private_dir, read_regular, read_whole
from .haproxy.config import Config, inject_observe
from .haproxy.global_policy import RefusedGlobal, move_stats_socket, supervised_global
from .haproxy.guard import SLOT_TABLE_PREFIX, SlotTable, inject_guard_and_table
from .haproxy.handoff import eligible_backends, inject_handoff, reserved_names_used
from .haproxy.handoff import map_path as handoff_map
from .haproxy.lexer import ConfigCache
from .haproxy.server_state import inject_server_state
from .master.processes import is_alive
from .settings import HAProxySettings, Settings, SettingsError, decode_text

log = logging.getLogger(__name__)


# Out of file descriptors or memory: the daemon's shortage, which passes, not a bad input.
SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


class RenderedConfigError(Exception):
    """The rendered config cannot be read: one line naming the file. `missing`: no file there (yet)."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Effective:
    rendered_text: str
    rendered_sha256: str
    text: str  # the effective config
    # The effective config as a model: the same thing Config.parse(text) gives (injections edit
    # whole lines through parse_line), kept so a big config is not parsed twice more.
    effective_model: Config
    slot_table: SlotTable | None = None  # the file the guard rules name; None with the guard off

    @cached_property
    def sha256(self) -> str:
        # Read several times per reload; hashing a big config once is enough.
        return sha256_text(self.text)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_rendered(path: Path, limit: int = DEFAULT_MAX_READ_BYTES, whole: bool = False) -> str:
    """The rendered config's text: a regular file, UTF-8, at most `limit` bytes; `whole`: files.read_whole."""
    try:
        return decode_text(read_whole(path, limit) if whole else read_regular(path, limit))
    except OSError as exc:
        if exc.errno in SHORTAGE_ERRNOS:
            raise  # the daemon's own shortage, not the file's fault: the reloader retries
        raise RenderedConfigError(
            f"{path}: cannot read rendered config: {exc.strerror or exc}", missing=exc.errno == errno.ENOENT
        ) from None
    except ValueError as exc:
        raise RenderedConfigError(f"{path}: rendered config {exc}") from None


def effective_config_and_table(rendered: Config, settings: Settings) -> tuple[Config, SlotTable | None]:
    """The rendered config after every injection the settings switch on, and the slot table it names."""
    config = rendered
    if settings.observe.enabled:
        config = inject_observe(config, settings.observe.error_limit)
    if settings.reload.preserve_server_state:
        config = inject_server_state(config, settings.haproxy.server_state_file)
    table = None
    unguarded = config
    try:
        if settings.old_workers.guard:
            # The injections above keep every server's name and `backup` flag: the table is the rendered config's.
            config, table = inject_guard_and_table(config, settings.haproxy.steer_map, settings.haproxy.runtime_dir)
        if settings.old_workers.hand_off:
            used = reserved_names_used(rendered)
            if used:
                names = ", ".join(used)
                raise RenderedConfigError(f"{settings.haproxy.config}: {names}: reserved for old_workers.hand_off")
            # After the guard: the slot table names no hand-off server.
            config = inject_handoff(config, eligible_backends(unguarded), settings.haproxy.runtime_dir)
    except ValueError as exc:  # a runtime_dir no map() argument can name
        raise SettingsError(str(exc)) from None
    return config, table


# What the daemon's builds of consecutive rendered configs share (lines, servers, guard
# plans): each build starts a generation of it, nothing else parses with it.
RENDERED_CONFIGS = ConfigCache()


def build_effective(settings: Settings, rendered_text: str, cache: ConfigCache = RENDERED_CONFIGS) -> Effective:
    """The rendered config minus the global keywords that conflict with being supervised, plus injections."""
    cache.new_generation()
    model = Config.parse(rendered_text, cache)
    try:
        supervised, notes = supervised_global(model, settings.haproxy.master_socket_path)
    except RefusedGlobal as exc:
        raise RenderedConfigError(f"{settings.haproxy.config}: {exc}") from None
    for note in notes:
        log.warning("%s: %s", settings.haproxy.config, note)
    if settings.haproxy.move_stats_socket:
        supervised, _ = move_stats_socket(supervised, settings.haproxy.stats_socket)
    effective, table = effective_config_and_table(supervised, settings)
    return Effective(rendered_text, sha256_text(rendered_text), effective.render(), effective, table)


def load_effective(settings: Settings) -> Effective:
    """build_effective() on the rendered config once its writer is done (else WriterBusy)."""
    h = settings.haproxy
    return build_effective(settings, read_rendered(h.config, h.max_config_bytes, whole=True))


T = TypeVar("T")


async def off_the_loop(work: Callable[[], T]) -> T:
    """Run `work` in the default executor's thread: parsing a big config takes seconds. The parse
    caches it shares with the loop hold immutable values keyed by content: a race costs a miss."""
    return await asyncio.get_running_loop().run_in_executor(None, work)


def write_slot_table(table: SlotTable | None) -> None:
    """Put the slot table on disk before a config naming it is read; named by its hash, one there is the same."""
    if table is not None:
        create_if_missing(table.path, table.text.encode())


# A slot table younger than this is left alone: a `check` may be validating the config naming it.
SLOT_TABLE_GRACE_S = 60.0


def remove_stale_slot_tables(directory: Path, keep: SlotTable | None) -> list[Path]:
    """Delete the slot tables no config on disk needs: old workers loaded theirs when they started."""
    now = time.time()
    removed: list[Path] = []
    for path in directory.glob(f"{SLOT_TABLE_PREFIX}*.map"):
        if keep is not None and path == keep.path:
            continue
        try:
            if now - path.stat().st_mtime < SLOT_TABLE_GRACE_S:
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def prepare_runtime_dir(settings: Settings) -> None:
    """The runtime dir and the files the effective config refers to, before `haproxy -c`."""
    ensure_private_dir(settings.haproxy.runtime_dir)
    # Empty on disk on purpose: a worker starts with no steering; only old ones get entries.
    create_if_missing(settings.haproxy.steer_map, b"")
    if settings.old_workers.hand_off:
        create_if_missing(handoff_map(settings.haproxy.runtime_dir), b"")
    if settings.reload.preserve_server_state:
        # A state file with no server (haproxy.server_state.EMPTY_STATE): loads without a warning.
        create_if_missing(settings.haproxy.server_state_file, b"1\n")


def source_lines(rendered_text: str, effective_text: str) -> list[int]:
    """For each line of the effective config, the rendered config's line it comes from: the same, the
    one an injection edited, or, for one an injection added, the line before it (1 when none)."""
    rendered, effective = rendered_text.splitlines(), effective_text.splitlines()
    lines: list[int] = []
    matcher = difflib.SequenceMatcher(None, rendered, effective, autojunk=False)
    for tag, r1, r2, e1, e2 in matcher.get_opcodes():
        for offset in range(e2 - e1):
            if tag == "equal" or (tag == "replace" and offset < r2 - r1):
                lines.append(r1 + offset + 1)
            elif tag == "replace":
                lines.append(r2)
            else:  # inserted
                lines.append(max(r1, 1))
    return lines


def name_rendered_lines(message: str, checked: str, rendered: Path, lines: list[int]) -> str:
    """HAProxy's messages about `checked` (the effective config) as if it had checked the rendered
    file: `[<checked>:N]` names the rendered line N came from."""

    def located(m: re.Match[str]) -> str:
        number = int(m[1])
        source = lines[number - 1] if 0 < number <= len(lines) else number
        return f"[{rendered}:{source}]"

    named = re.sub(rf"\[{re.escape(checked)}:(\d+)\]", located, message)
    return named.replace(checked, str(rendered))


@dataclass
class ConfigCheck:
    """`haproxy -c` under way while the caller works on. `source`: the rendered config's path and text,
    which the messages name instead of the copy checked (None: `<effective config>`)."""

    tmp: Path | None  # the copy checked; None: `text` through a pipe (no room for a copy)
    proc: asyncio.subprocess.Process | None
    error: str | None
    text: str = ""
    source: tuple[Path, str] | None = None

    async def verdict(self) -> tuple[bool, str]:
        """(valid, HAProxy's own message); removes the copy it checked."""
        try:
            if self.proc is None:
                return False, self.error or "haproxy -c did not start"
            out, _ = await self.proc.communicate(self.text.encode() if self.tmp is None else None)
            checked = STDIN_PATH if self.tmp is None else str(self.tmp)
            message = out.decode(errors="replace").strip()
            if self.source is not None and checked in message:
                path, rendered_text = self.source
                message = await off_the_loop(
                    lambda: name_rendered_lines(message, checked, path, source_lines(rendered_text, self.text)))
            else:
                message = message.replace(checked, "<effective config>")
            # Go by the exit code: 2.6 prints ALERTs for some configs it still accepts.
            return self.proc.returncode == 0, message
        finally:
            if self.tmp is not None:
                self.tmp.unlink(missing_ok=True)


async def start_effective_check(h: HAProxySettings, effective: Effective) -> ConfigCheck:
    """start_check() once the slot table it names (the check opens it) is on disk."""
    write_slot_table(effective.slot_table)
    return await start_check(h.binary, effective.text, h.runtime_dir, (h.config, effective.rendered_text))


async def check_effective(h: HAProxySettings, effective: Effective) -> tuple[bool, str]:
    return await (await start_effective_check(h, effective)).verdict()


CHECK_PREFIX, CHECK_SUFFIX = ".validate.", ".cfg"
STDIN_PATH = "/dev/stdin"
# No room for the check's copy of the config in runtime_dir.
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def remove_stale_checks(directory: Path) -> list[Path]:
    """Delete the copies `haproxy -c` was checking when their maker was killed; a living one's stay."""
    removed = []
    for path in directory.glob(f"{CHECK_PREFIX}*{CHECK_SUFFIX}"):
        maker, _, _ = path.name[len(CHECK_PREFIX):-len(CHECK_SUFFIX)].partition(".")  # .validate.<pid>.<random>.cfg
        if maker.isdigit() and int(maker) != os.getpid() and is_alive(int(maker)):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


async def start_check(binary: str, text: str, directory: Path, source: tuple[Path, str] | None = None) -> ConfigCheck:
    """Start `haproxy -c` on `text`; the caller must ask for the verdict, which reaps it and removes the
    copy. On a full or read-only runtime_dir, HAProxy reads the config from a pipe."""
    tmp: Path | None = None
    try:
        try:
            # Named by its maker: remove_stale_checks leaves a living process's copy alone.
            fd, name = tempfile.mkstemp(dir=directory, prefix=f"{CHECK_PREFIX}{os.getpid()}.", suffix=CHECK_SUFFIX)
            tmp = Path(name)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except OSError as exc:
            if exc.errno not in NO_ROOM_ERRNOS:
                raise
            if tmp is not None:
                tmp.unlink(missing_ok=True)
                tmp = None
        try:
            proc = await asyncio.create_subprocess_exec(
                binary, "-c", "-f", STDIN_PATH if tmp is None else str(tmp),
                stdin=asyncio.subprocess.PIPE if tmp is None else None,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            if exc.errno in SHORTAGE_ERRNOS:
                raise  # out of descriptors: a passing failure for the reloader to retry, not a verdict
            return ConfigCheck(tmp, None, f"cannot run {binary}: {exc.strerror or exc}")
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    return ConfigCheck(tmp, proc, None, text, source)
