"""The observe injection: `observe layer4 ... on-error mark-down` on every server line that
wants it, so that a worker marks a server down by its own traffic, between health checks.

A pure function Config -> Config that leaves the input alone; switched off, the effective
config is the rendered one.
"""

from __future__ import annotations

from .config import Config
from .resolution import Server, ServerFlags


def observe_directive(error_limit: int) -> str:
    return f"observe layer4 error-limit {error_limit} on-error mark-down"


def wants_observe(server: Server | ServerFlags) -> bool:
    """Primary servers with health checks, not already observed.

    `observe` without `check` silently does nothing, and on a `track` server
    `check` is a fatal config error, so neither gets it; backups are the
    fallback the mark-down exists to reach, so they never get marked down.
    """
    return server.check and not server.backup and server.track is None and not server.observe


def inject_observe(config: Config, error_limit: int) -> Config:
    """Add `observe layer4 ... on-error mark-down` to every server line that wants it."""
    result = config.copy()
    suffix = " " + observe_directive(error_limit)
    # Per line, not per server: a server-template line declares many servers with the same flags.
    for section, server_lines in result.server_flags_by_backend():
        for index, flags in server_lines:
            if wants_observe(flags):
                section.body[index] = section.body[index].with_appended(suffix, result.cache.line)
    return result
