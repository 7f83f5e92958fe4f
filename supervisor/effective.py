"""From the rendered config on disk to a validated effective config.

The rendered file belongs to the controller and is never written to; the
effective config (rendered + injections) lives in runtime_dir.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .haproxy.config import Config
from .haproxy.inject import SLOT_TABLE_PREFIX, SlotTable, effective_config_and_table
from .settings import Settings


class RenderedConfigError(Exception):
    """The rendered config cannot be read. One line, names the file."""


@dataclass(frozen=True)
class Effective:
    rendered_text: str
    rendered_sha256: str
    model: Config  # the parsed rendered config, before injections
    text: str  # the effective config
    # The effective config as a model: the same thing Config.parse(text) gives (injections edit
    # whole lines through parse_line), kept so a 10,000-server config is not parsed twice more.
    effective_model: Config
    slot_table: SlotTable | None = None  # the file the guard rules name; None with the guard off

    @cached_property
    def sha256(self) -> str:
        # Read several times per reload; hashing a 10,000-server config once is enough.
        return sha256_text(self.text)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_rendered(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise RenderedConfigError(f"{path}: cannot read rendered config: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise RenderedConfigError(f"{path}: rendered config is not UTF-8: {exc.reason}") from None


def build_effective(settings: Settings, rendered_text: str) -> Effective:
    model = Config.parse(rendered_text)
    effective, table = effective_config_and_table(model, settings)
    return Effective(rendered_text, sha256_text(rendered_text), model, effective.render(), effective, table)


def write_slot_table(table: SlotTable | None) -> None:
    """Put the slot table on disk before `haproxy -c` or a reload reads the config naming it.
    Its name is its content's hash: a file already there holds the same text."""
    if table is not None and not table.path.exists():
        write_atomically(table.path, table.text)


def write_effective(path: Path, effective: Effective) -> None:
    """Write the effective config, after the slot table it names: a config on disk never
    names a file that is not there."""
    write_slot_table(effective.slot_table)
    write_atomically(path, effective.text)


# A slot table younger than this is left alone: a `check` may be validating the config naming it.
SLOT_TABLE_GRACE_S = 60.0


def remove_stale_slot_tables(directory: Path, keep: SlotTable | None, now: float | None = None) -> list[Path]:
    """Delete the slot tables no config on disk needs any more.

    Only the running config's table is read again (by a master restarted on it, or a
    reload that falls back to it); old workers loaded theirs when they started.
    """
    now = time.time() if now is None else now
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
    """The runtime dir and the files the effective config refers to must exist before `haproxy -c`."""
    runtime = settings.haproxy.runtime_dir
    runtime.mkdir(parents=True, exist_ok=True)
    steer_map = settings.haproxy.steer_map
    if not steer_map.exists():
        # Empty on disk on purpose: a worker starts with no steering; only old ones get entries.
        steer_map.write_text("")
    state_file = settings.haproxy.server_state_file
    if settings.reload.preserve_server_state and not state_file.exists():
        # A state file with no server (haproxy.server_state.EMPTY_STATE): loads without a warning.
        state_file.write_text("1\n")


def write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def validate(binary: str, text: str, directory: Path) -> tuple[bool, str]:
    """Run `haproxy -c` on `text`. Returns (valid, HAProxy's own message)."""
    return await (await start_check(binary, text, directory)).verdict()


class ConfigCheck:
    """`haproxy -c` under way: HAProxy checks on a core of its own while the caller works on
    (the displaced-worker component works out the next config's steering meanwhile)."""

    def __init__(self, tmp: Path, proc: asyncio.subprocess.Process | None, error: str | None) -> None:
        self._tmp = tmp
        self._proc = proc
        self._error = error

    async def verdict(self) -> tuple[bool, str]:
        """(valid, HAProxy's own message); removes the copy it checked."""
        try:
            if self._proc is None:
                return False, self._error or "haproxy -c did not start"
            out, _ = await self._proc.communicate()
            message = out.decode(errors="replace").strip().replace(str(self._tmp), "<effective config>")
            # Go by the exit code: 2.6 prints ALERTs for some configs it still accepts.
            return self._proc.returncode == 0, message
        finally:
            self._tmp.unlink(missing_ok=True)


async def start_effective_check(binary: str, effective: Effective, directory: Path) -> ConfigCheck:
    """start_check() on an effective config, once the slot table it names is on disk (the
    check opens it)."""
    write_slot_table(effective.slot_table)
    return await start_check(binary, effective.text, directory)


async def start_check(binary: str, text: str, directory: Path) -> ConfigCheck:
    """Start `haproxy -c` on `text`; ConfigCheck.verdict() waits for its answer. The caller
    must ask for the verdict: that reaps the process and removes the copy."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=".validate.", suffix=".cfg")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            proc = await asyncio.create_subprocess_exec(
                binary, "-c", "-f", name,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            return ConfigCheck(tmp, None, f"cannot run {binary}: {exc.strerror or exc}")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ConfigCheck(tmp, proc, None)
