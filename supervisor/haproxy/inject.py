"""Injections: what the supervisor adds to the rendered config to make the effective one.

Each injection is a pure function Config -> Config that leaves the input alone.
With every injection switched off the effective config is byte-identical to
the rendered one.
"""

from __future__ import annotations

from ..settings import Settings
from .config import Config, Server


def observe_directive(error_limit: int) -> str:
    return f"observe layer4 error-limit {error_limit} on-error mark-down"


def wants_observe(server: Server) -> bool:
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
    for section, servers in result.servers_by_backend():
        # A server-template line declares many servers with the same flags: edit it once.
        lines_to_edit = sorted({s.line_index for s in servers if wants_observe(s)})
        for index in lines_to_edit:
            section.body[index] = section.body[index].with_appended(suffix)
    return result


def effective_config(rendered: Config, settings: Settings) -> Config:
    """The rendered config after every injection that the settings switch on."""
    config = rendered
    if settings.observe.enabled:
        config = inject_observe(config, settings.observe.error_limit)
    return config
