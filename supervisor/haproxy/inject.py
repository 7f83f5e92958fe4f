"""Injections: what the supervisor adds to the rendered config to make the effective one.

Each injection is a pure function Config -> Config that leaves the input alone.
With every injection switched off the effective config is byte-identical to
the rendered one.
"""

from __future__ import annotations

from pathlib import Path

from .config import Config, Section
from .lexer import Line, parse_line, quote_word
from .resolution import PROXY_KINDS, Server, ServerFlags


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
        # One pass: a backend inherits from some defaults once any defaults section preceded it
        # (or it names one with `from`); only those that do not need the line of their own.
        seen_defaults = False
        for section in result.sections:
            seen_defaults = seen_defaults or section.kind == "defaults"
            if section.kind == "defaults" or (
                section.kind in ("backend", "listen") and not seen_defaults and section.from_defaults is None
            ):
                _append_line(section, "load-server-state-from-file global")
    return result


# ---------------------------------------------------------------- global keywords


class RefusedGlobal(ValueError):
    """The rendered config's global section holds a keyword the daemon cannot supervise. One line."""


# Global keywords that conflict with being supervised, and why. The daemon starts HAProxy as
# its own child, `haproxy -W -S <master.sock> -f <effective> -p <pid file>`, in the foreground.
# Dropped: the keyword only fights the daemon for the master; without it HAProxy runs as the
# rendered config means it to. Each drop is logged at every build.
DROPPED_GLOBALS = {
    "daemon": "the supervisor runs the HAProxy master in the foreground as its own child; "
    "with `daemon` the master would fork away and run unsupervised",
    "pidfile": "the supervisor passes its own pid file with -p, which overrides this one (HAProxy "
    "never writes it); a controller must not signal HAProxy itself",
}
# `master-worker` alone only says what -W already says, and 3.3+ deprecates it (a warning at
# every check; 3.5 removes it); with `no-exit-on-failure` it would decide what a crashed
# worker does, which is the supervisor's decision.
MASTER_WORKER_WHY = (
    "the supervisor starts HAProxy with -W, which says the same; HAProxy 3.3 deprecates the keyword "
    "and 3.5 removes it"
)
NO_EXIT_ON_FAILURE = "no-exit-on-failure"
NO_EXIT_ON_FAILURE_WHY = (
    "what a crashed worker does is the supervisor's decision, not the rendered config's "
    "(HAProxy's default: the master exits and the supervisor restarts it)"
)
# Refused: no edit makes the config mean what its author meant under the supervisor.
REFUSED_GLOBALS = {
    "nbproc": "multi-process mode was removed in HAProxy 2.5 (threads replace it); "
    "the supervisor tracks one worker per config",
}


def supervised_global(config: Config, master_socket: Path) -> tuple[Config, list[str]]:
    """The rendered config without the global lines that conflict with being supervised, and a
    line saying so for each one dropped; RefusedGlobal for a line that cannot be supervised.

    Lines are named by their line number in the rendered config.
    """
    number = 0
    dropped: list[tuple[int, Line]] = []  # (index of the section, the line)
    notes: list[str] = []
    for index, section in enumerate(config.sections):
        if section.header is not None:
            number += 1
        if section.kind != "global":
            number += len(section.body)
            continue
        for line in section.body:
            number += 1
            words = line.words
            keyword = words[0] if words else ""
            if keyword in REFUSED_GLOBALS:
                raise RefusedGlobal(f"line {number}: global `{keyword}` refused: {REFUSED_GLOBALS[keyword]}")
            if keyword == "stats" and words[1:2] == ("socket",) and len(words) > 2:
                path = words[2].removeprefix("unix@")
                if Path(path) == master_socket:
                    raise RefusedGlobal(
                        f"line {number}: `stats socket {words[2]}` refused: it is the supervisor's master socket"
                    )
            why = DROPPED_GLOBALS.get(keyword)
            if why is None and keyword == "master-worker":
                why = NO_EXIT_ON_FAILURE_WHY if NO_EXIT_ON_FAILURE in words[1:] else MASTER_WORKER_WHY
            if why is not None:
                dropped.append((index, line))
                notes.append(f"line {number}: global `{' '.join(words)}` dropped from the effective config: {why}")
    if not dropped:
        return config, notes
    result = config.copy()
    for index, line in dropped:
        edited = result.sections[index]
        edited.body = [kept for kept in edited.body if kept is not line]
    return result, notes


def first_stats_socket(config: Config) -> tuple[str, ...] | None:
    """The words of the first global `stats socket` line that names an address."""
    for section in config.sections:
        if section.kind == "global":
            for line in section.body:
                if line.keyword == "stats" and line.words[1:2] == ("socket",) and len(line.words) > 2:
                    return line.words
    return None


def move_stats_socket(config: Config, path: Path) -> tuple[Config, str | None]:
    """The config with its first global `stats socket` bound at `path` instead, its other words
    kept (mode, level, expose-fd ...), and the address it had (None: no stats socket, the config
    is returned as it is). A bridge that stands in for HAProxy (haproxy-supervisor-ray-bridge)
    binds the old address itself and relays to `path`."""
    for index, section in enumerate(config.sections):
        if section.kind != "global":
            continue
        for position, line in enumerate(section.body):
            words = line.words
            if line.keyword == "stats" and words[1:2] == ("socket",) and len(words) > 2:
                moved = " ".join(["stats", "socket", quote_word(str(path)), *map(quote_word, words[3:])])
                result = config.copy()
                body = result.sections[index].body
                # What follows the last word (a comment, the line ending) stays as it was.
                body[position] = parse_line(f"{line.indent}{moved}{line.raw[line.code_end :]}")
                return result, words[2]
    return config, None
