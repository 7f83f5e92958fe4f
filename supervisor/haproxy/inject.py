"""Injections: what the supervisor adds to the rendered config to make the effective one.

Each injection is a pure function Config -> Config that leaves the input alone.
With every injection switched off the effective config is byte-identical to
the rendered one.
"""

from __future__ import annotations

from pathlib import Path

from ..settings import Settings
from .config import PROXY_KINDS, Config, Line, Section, Server, parse_line, quote_word


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


def _append_line(section: Section, words: str) -> None:
    """Add a line after the section's last code line, indented and ended like its neighbours."""
    code = [i for i, line in enumerate(section.body) if line.words]
    neighbour: Line | None = section.body[code[-1]] if code else section.header
    indent = (neighbour.indent if code and neighbour is not None else "") or "    "
    ended = [line for line in (neighbour, section.header) if line is not None and line.raw.endswith("\n")]
    ending = "\r\n" if ended and ended[0].raw.endswith("\r\n") else "\n"
    if neighbour is not None and not neighbour.raw.endswith("\n"):
        # The last line of a file without a final newline must not swallow the new one.
        fixed = parse_line(neighbour.raw + ending)
        if code:
            section.body[code[-1]] = fixed
        else:
            section.header = fixed
    section.body.insert(code[-1] + 1 if code else 0, parse_line(f"{indent}{words}{ending}"))


def inject_server_state(config: Config, path: Path) -> Config:
    """Make the worker load the server state saved before a reload, unless the config already does.

    `server-state-file <path>` goes into global, `load-server-state-from-file global`
    into every defaults section (and into backends that have no defaults to inherit
    from). Each is left out when the rendered config already uses that keyword:
    then it manages server state itself.
    """
    result = config.copy()
    if result.global_setting("server-state-file") is None:
        global_section = next((s for s in result.sections if s.kind == "global"), None)
        if global_section is None:
            global_section = Section(parse_line("global\n"))
            result.sections.insert(1, global_section)
        _append_line(global_section, f"server-state-file {quote_word(str(path))}")
    already_loads = any(
        line.keyword == "load-server-state-from-file"
        for section in result.sections
        if section.kind in PROXY_KINDS
        for line in section.body
    )
    if not already_loads:
        for section in result.sections:
            if section.kind == "defaults" or (
                section.kind in ("backend", "listen") and result.defaults_for(section) is None
            ):
                _append_line(section, "load-server-state-from-file global")
    return result


def effective_config(rendered: Config, settings: Settings) -> Config:
    """The rendered config after every injection that the settings switch on."""
    config = rendered
    if settings.observe.enabled:
        config = inject_observe(config, settings.observe.error_limit)
    if settings.reload.preserve_server_state:
        config = inject_server_state(config, settings.haproxy.server_state_file)
    return config
