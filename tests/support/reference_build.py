"""A straightforward build of the effective config, to hold the fast one to byte-identity.

This is the code `supervisor.effective.build_effective` ran before it was made fast (parse
every line on its own, resolve every server with its `default-server` settings, parse the
guard's lines anew for each backend), kept here with no cache and no shortcut. It reuses
the model's containers (Line, Section, Config) and the guard's text (guard_rules,
guard_use_server: they belong to the guard, not to how fast it is built), nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from supervisor.haproxy.config import SECTION_KEYWORDS, Config, Section, observe_directive
from supervisor.haproxy.global_policy import supervised_global
from supervisor.haproxy.guard import (
    _RULE_RANK,
    GUARD_MARKER,
    _above_comments,
    _rank,
    guard_redispatch,
    guard_rules,
    guard_use_server,
)
from supervisor.haproxy.lexer import Line, quote_word
from supervisor.haproxy.resolution import BACKEND_KINDS, PROXY_KINDS, SERVER_KEYWORDS_WITH_ARG, Server, template_names
from supervisor.haproxy.routing import routing_of, server_ids
from supervisor.settings import Settings


def parse_line(raw: str) -> Line:
    body = raw.rstrip("\r\n")
    if "\\" not in body and '"' not in body and "'" not in body:
        code = body.split("#", 1)[0]
        stripped = code.rstrip(" \t")
        return Line(raw, tuple(stripped.split()), len(stripped))
    words: list[str] = []
    current: list[str] = []
    in_word = False
    quote = ""
    code_end = 0
    i = 0
    n = len(body)
    while i < n:
        c = body[i]
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"' and i + 1 < n:
                i += 1
                current.append(body[i])
            else:
                current.append(c)
            i += 1
            code_end = i
            continue
        if c in " \t":
            if in_word:
                words.append("".join(current))
                current = []
                in_word = False
            i += 1
            continue
        if c == "#":
            break
        in_word = True
        if c in "\"'":
            quote = c
        elif c == "\\" and i + 1 < n:
            i += 1
            current.append(body[i])
        else:
            current.append(c)
        i += 1
        code_end = i
    if in_word or quote:
        words.append("".join(current))
    return Line(raw, tuple(words), code_end)


def parse(text: str) -> Config:
    sections = [Section(None)]
    for raw in text.splitlines(keepends=True):
        line = parse_line(raw)
        if line.keyword in SECTION_KEYWORDS:
            sections.append(Section(line))
        else:
            sections[-1].body.append(line)
    return Config(sections)


def with_appended(line: Line, text: str) -> Line:
    return parse_line(line.raw[: line.code_end] + text + line.raw[line.code_end :])


@dataclass(frozen=True)
class Flags:
    check: bool = False
    backup: bool = False
    observe: bool = False
    track: str | None = None

    def apply(self, params: tuple[str, ...]) -> Flags:
        check, backup, observe, track = self.check, self.backup, self.observe, self.track
        i = 0
        while i < len(params):
            p = params[i]
            arg = params[i + 1] if i + 1 < len(params) else None
            if p == "check":
                check = True
            elif p == "no-check":
                check = False
            elif p == "backup":
                backup = True
            elif p == "no-backup":
                backup = False
            elif p == "observe":
                observe = True
            elif p == "track":
                track = arg
            if p in SERVER_KEYWORDS_WITH_ARG:
                i += 1
            i += 1
        return Flags(check, backup, observe, track)


def defaults_for(config: Config, section: Section) -> Section | None:
    """HAProxy's rule: the defaults named by `from`; else, for a proxy, the last defaults before
    it; a defaults section without `from` inherits nothing."""
    wanted = section.from_defaults
    if wanted is None and section.kind == "defaults":
        return None
    last: Section | None = None
    for other in config.sections:
        if other is section:
            break
        if other.kind == "defaults" and (wanted is None or other.name == wanted):
            last = other
    return last


def chain(config: Config, section: Section) -> list[Section]:
    """The defaults sections a section inherits from, the farthest first."""
    defaults = defaults_for(config, section)
    return [] if defaults is None else [*chain(config, defaults), defaults]


def mode_of(config: Config, section: Section) -> str:
    mode = "tcp"
    for source in [*chain(config, section), section]:
        for line in source.body:
            if line.keyword == "mode" and len(line.words) > 1:
                mode = line.words[1]
    return mode


def servers(config: Config, section: Section) -> Iterator[tuple[int, Flags]]:
    """(line index, flags) of every server of a backend, one per server, templates expanded."""
    flags = Flags()
    for defaults in chain(config, section):
        for line in defaults.body:
            if line.keyword == "default-server":
                flags = flags.apply(line.words[1:])
    for index, line in enumerate(section.body):
        kw = line.keyword
        if kw == "default-server":
            flags = flags.apply(line.words[1:])
        elif kw == "server" and len(line.words) >= 3:
            yield index, flags.apply(line.words[3:])
        elif kw == "server-template" and len(line.words) >= 4:
            for _ in template_names(line.words[1], line.words[2]):
                yield index, flags.apply(line.words[4:])


def copy(config: Config) -> Config:
    return Config([Section(s.header, list(s.body)) for s in config.sections])


def backends(config: Config) -> list[Section]:
    return [s for s in config.sections if s.kind in BACKEND_KINDS]


def inject_observe(config: Config, error_limit: int) -> Config:
    result = copy(config)
    suffix = " " + observe_directive(error_limit)
    for section in backends(result):
        wanted = sorted(
            {i for i, f in servers(result, section) if f.check and not f.backup and f.track is None and not f.observe}
        )
        for index in wanted:
            section.body[index] = with_appended(section.body[index], suffix)
    return result


def _append_line(section: Section, words: str) -> None:
    code = [i for i, line in enumerate(section.body) if line.words]
    neighbour: Line | None = section.body[code[-1]] if code else section.header
    indent = (neighbour.indent if code and neighbour is not None else "") or "    "
    ended = [line for line in (neighbour, section.header) if line is not None and line.raw.endswith("\n")]
    ending = "\r\n" if ended and ended[0].raw.endswith("\r\n") else "\n"
    if neighbour is not None and not neighbour.raw.endswith("\n"):
        fixed = parse_line(neighbour.raw + ending)
        if code:
            section.body[code[-1]] = fixed
        else:
            section.header = fixed
    section.body.insert(code[-1] + 1 if code else 0, parse_line(f"{indent}{words}{ending}"))


def inject_server_state(config: Config, path: Path) -> Config:
    result = copy(config)
    if not any(line.keyword == "server-state-file" for s in result.sections if s.kind == "global" for line in s.body):
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
        seen_defaults = False
        for section in result.sections:
            seen_defaults = seen_defaults or section.kind == "defaults"
            if section.kind == "defaults" or (
                section.kind in ("backend", "listen") and not seen_defaults and section.from_defaults is None
            ):
                _append_line(section, "load-server-state-from-file global")
    return result


def slot_table_path(config: Config, directory: Path) -> Path:
    """Where the slot table of `config` goes: named by the hash of its text, which lists
    every primary server of every backend, `<backend>_<i> <name>` in config order."""
    rows = [
        f"{section.name}_{i} {name}\n"
        for section in backends(config)
        for i, name in enumerate(s.name for s in config.servers(section) if not s.backup)
    ]
    # Then what cookies and stick entries can name: the home slot of each primary.
    for section in backends(config):
        servers = config.servers(section)
        home = {s.name: i for i, s in enumerate(s for s in servers if not s.backup)}
        if not home:
            continue
        routing = routing_of(config.settings_of(section), section.body, section.name)
        if routing.cookie:
            first: dict[str, Server] = {}
            for server in servers:
                if server.cookie is not None:
                    first.setdefault(server.cookie, server)
            rows += [f"{section.name}/c{value} {home[s.name]}\n" for value, s in first.items() if not s.backup]
        if routing.sticks:
            ids = server_ids([(s.name, s.params) for s in servers])
            rows += [f"{section.name}/s{ids[s.name]} {home[s.name]}\n" for s in servers if not s.backup]
    return directory / f"slots-{hashlib.sha256(''.join(rows).encode()).hexdigest()[:16]}.map"


def inject_guard(config: Config, map_path: str | Path, table_path: Path) -> Config:
    result = copy(config)
    for section in backends(result):
        flags = [f for _, f in servers(result, section)]
        if all(f.backup for f in flags) or any(line.raw.strip() == GUARD_MARKER for line in section.body):
            continue
        mode = mode_of(result, section)
        indent = next((line.indent for line in section.body if line.words), "") or "    "
        newline = "\r\n" if section.header is not None and section.header.raw.endswith("\r\n") else "\n"
        if section.header is not None and not section.header.raw.endswith("\n"):
            section.header = parse_line(section.header.raw + newline)

        def lines(texts: list[str], newline: str = newline, indent: str = indent) -> list[Line]:
            return [parse_line(f"{indent}{text}{newline}") for text in texts]

        body = section.body
        own_rank = _RULE_RANK["tcp-request" if mode != "http" else "http-request"]
        ranks = [_rank(line) for line in body]
        ranked = [i for i, r in enumerate(ranks) if r is not None]
        at = next((i for i in ranked if ranks[i] >= own_rank), ranked[-1] + 1 if ranked else 0)
        first_use_server = next((i for i in ranked if ranks[i] == _RULE_RANK["use-server"]), None)
        routing = routing_of(result.settings_of(section), section.body, section.name)
        redispatch = guard_redispatch(result.settings_of(section))
        rules = lines([GUARD_MARKER, *redispatch, *guard_rules(mode, str(map_path), str(table_path), routing)])
        if first_use_server is None:
            later = [i for i in ranked if i >= at]
            use_at = (later[-1] + 1) if later else at
        else:
            use_at = first_use_server
        at, use_at = _above_comments(body, at), _above_comments(body, use_at)
        use_server = lines([guard_use_server()])
        if use_at != at:
            use_server = lines([GUARD_MARKER]) + use_server
        body[use_at:use_at] = use_server
        body[at:at] = rules
    return result


def reference_effective(text: str, settings: Settings) -> tuple[str, Config]:
    """(effective text, effective model) the straightforward way."""
    # The global policy is no part of the speed-up: the reference takes it as it is.
    config, _ = supervised_global(parse(text), settings.haproxy.master_socket_path)
    table_path = slot_table_path(config, settings.haproxy.runtime_dir)
    if settings.observe.enabled:
        config = inject_observe(config, settings.observe.error_limit)
    if settings.reload.preserve_server_state:
        config = inject_server_state(config, settings.haproxy.server_state_file)
    if settings.old_workers.guard:
        config = inject_guard(config, settings.haproxy.steer_map, table_path)
    return "".join(line.raw for s in config.sections for line in s.lines()), config
