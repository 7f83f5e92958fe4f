"""The rendered config's global section under supervision: the keywords that conflict with
being supervised, dropped or refused, and the stats socket moved for the Ray bridge."""

from __future__ import annotations

from pathlib import Path

from .config import Config
from .lexer import Line, parse_line, quote_word


class RefusedGlobal(ValueError):
    """The rendered config's global section holds a keyword the daemon cannot supervise. One line."""


# Global keywords that only fight the daemon for the master (`haproxy -W -S ... -p ...`), and why:
# dropped, and logged at every build.
DROPPED_GLOBALS = {
    "daemon": "the supervisor runs the HAProxy master in the foreground as its own child; "
    "with `daemon` the master would fork away and run unsupervised",
    "pidfile": "the supervisor passes its own pid file with -p, which overrides this one (HAProxy "
    "never writes it); a controller must not signal HAProxy itself",
}
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
    note for each, by line number; RefusedGlobal for one that cannot be dropped."""
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
            words, keyword = line.words, line.keyword
            if keyword in REFUSED_GLOBALS:
                raise RefusedGlobal(f"line {number}: global `{keyword}` refused: {REFUSED_GLOBALS[keyword]}")
            if _is_stats_socket(line) and Path(words[2].removeprefix("unix@")) == master_socket:
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


def _is_stats_socket(line: Line) -> bool:
    return line.keyword == "stats" and line.words[1:2] == ("socket",) and len(line.words) > 2


def _first_stats_socket(config: Config) -> tuple[int, int, Line] | None:
    """(section index, body index, line) of the first global `stats socket` that names an address."""
    for index, section in enumerate(config.sections):
        if section.kind == "global":
            for position, line in enumerate(section.body):
                if _is_stats_socket(line):
                    return index, position, line
    return None


def first_stats_socket(config: Config) -> tuple[str, ...] | None:
    found = _first_stats_socket(config)
    return found[2].words if found is not None else None


def move_stats_socket(config: Config, path: Path) -> tuple[Config, str | None]:
    """The config with its first global `stats socket` bound at `path`, its other words kept, and
    the address it had (None: none); the Ray bridge binds that address and relays to `path`."""
    found = _first_stats_socket(config)
    if found is None:
        return config, None
    index, position, line = found
    moved = " ".join(["stats", "socket", quote_word(str(path)), *map(quote_word, line.words[3:])])
    result = config.copy()
    # What follows the last word (a comment, the line ending) stays as it was.
    result.sections[index].body[position] = parse_line(f"{line.indent}{moved}{line.raw[line.code_end :]}")
    return result, line.words[2]
