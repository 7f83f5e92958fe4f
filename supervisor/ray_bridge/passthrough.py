"""Queries that start nothing (`-v`, `-vv`, `-c` ...), answered by the daemon's own HAProxy binary."""

from __future__ import annotations

import os
import sys

from ..binary import names_the_bridge, resolve_binary
from ..settings import Settings


def real_binary(settings: Settings) -> str:
    """The daemon's HAProxy binary; ValueError if it resolves to the bridge itself."""
    binary = resolve_binary(settings.haproxy.binary)
    if names_the_bridge(binary):
        raise ValueError(f"haproxy.binary {settings.haproxy.binary!r} resolves to the bridge itself ({binary})")
    return binary


def exec_real_binary(settings: Settings, args: tuple[str, ...]) -> None:
    """Become the daemon's HAProxy binary for a query: its answer and exit code are HAProxy's."""
    from .main import BridgeError

    try:
        binary = real_binary(settings)
    except ValueError as exc:
        raise BridgeError(str(exc)) from None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(binary, [binary, *args])
    except OSError as exc:
        raise BridgeError(f"cannot run {binary}: {exc.strerror or exc}") from None
