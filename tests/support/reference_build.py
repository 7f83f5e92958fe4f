"""The effective config built the plain way, written apart from the product, to hold the fast
build to byte-identity.

Nothing here is the product's code: the lexer is a regular expression over HAProxy's quoting
rules (configuration.txt 2.2), the flags are a table walked once per server line, the
injections find their place by reading the section again each time. It reuses the model's
containers (Line, Section, Config), the keyword tables and the text each injection writes
(the guard's rules, the observe directive): what is written is not what is under test, where
and how it is written is.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from supervisor.haproxy.config import SECTION_KEYWORDS, Config, observe_directive
from supervisor.haproxy.global_policy import supervised_global
from supervisor.haproxy.guard import GUARD_MARKER, guard_redispatch, guard_rules, guard_use_server
from supervisor.haproxy.lexer import Line, Section, quote_word
from supervisor.haproxy.resolution import (
    BACKEND_KINDS,
    PROXY_KINDS,
    SERVER_KEYWORDS_WITH_ARG,
    ProxySettings,
    Server,
    resolve,
    section_servers,
    template_names,
)
from supervisor.haproxy.routing import routing_of, server_ids
from supervisor.settings import Settings

# ---------------------------------------------------------------- the lexer

# One token at a time: blanks between words, a comment, a quoted run, an escape, any other
# character. A run of tokens with no blank between them is one word. HAProxy's isspace()
# also takes \v and \f for blanks; \r and \n only end a line.
_TOKEN = re.compile(r"""(?P<blank>[ \t\v\f]+)|(?P<comment>\#.*)|'(?P<strong>[^']*)'?|"(?P<weak>(?:\\.|[^"])*)"?"""
                    r"""|\\(?P<escaped>.)|(?P<plain>.)""", re.DOTALL)
_WEAK_ESCAPE = re.compile(r"\\(.)", re.DOTALL)


def parse_line(raw: str) -> Line:
    body = raw.rstrip("\r\n")
    words: list[str] = []
    word: str | None = None  # None: between words
    last_code = 0  # where the last word's last token ends
    code = len(body)  # where a comment starts
    for token in _TOKEN.finditer(body):
        kind = token.lastgroup
        if kind == "comment":
            code = token.start()
            break
        if kind == "blank":
            if word is not None:
                words.append(word)
            word = None
            continue
        text = token.group(kind)  # a lone backslash at the end of the line is a plain character
        word = (word or "") + (_WEAK_ESCAPE.sub(r"\1", text) if kind == "weak" else text)
        last_code = token.end()
    if word is not None:
        words.append(word)
    # The code ends before trailing blanks, unless an escape or a quote holds them.
    return Line(raw, tuple(words), max(last_code, len(body[:code].rstrip(" \t\v\f"))))


def parse(text: str) -> Config:
    sections = [Section(None)]
    for raw in text.splitlines(keepends=True):
        line = parse_line(raw)
        if line.words and line.words[0] in SECTION_KEYWORDS:
            sections.append(Section(line))
        else:
            sections[-1].body.append(line)
    return Config(sections)


def with_appended(line: Line, text: str) -> Line:
    return parse_line(line.raw[: line.code_end] + text + line.raw[line.code_end :])


# ---------------------------------------------------------------- defaults and server flags

# A flag keyword -> (which flag, its value); `track` takes the next word.
_FLAGS = {"check": ("check", True), "no-check": ("check", False), "backup": ("backup", True),
          "no-backup": ("backup", False), "observe": ("observe", True)}  # fmt: skip


class Flags(NamedTuple):
    check: bool = False
    backup: bool = False
    observe: bool = False
    track: str | None = None


def flags_after(flags: Flags, params: tuple[str, ...]) -> Flags:
    words = iter(params)
    for word in words:
        if word in _FLAGS:
            name, value = _FLAGS[word]
            flags = flags._replace(**{name: value})
        elif word == "track":
            flags = flags._replace(track=next(words, None))
            continue
        if word in SERVER_KEYWORDS_WITH_ARG:
            next(words, None)
    return flags


def defaults_for(config: Config, section: Section) -> Section | None:
    """HAProxy's rule: the defaults named by `from`; else, for a proxy, the last defaults before
    it; a defaults section without `from` inherits nothing."""
    wanted = section.from_defaults
    if wanted is None and section.kind == "defaults":
        return None
    before = config.sections[: next(i for i, s in enumerate(config.sections) if s is section)]
    found = [s for s in before if s.kind == "defaults" and (wanted is None or s.name == wanted)]
    return found[-1] if found else None


def chain(config: Config, section: Section) -> list[Section]:
    """The defaults sections a section inherits from, the farthest first."""
    defaults = defaults_for(config, section)
    return [] if defaults is None else [*chain(config, defaults), defaults]


def mode_of(config: Config, section: Section) -> str:
    modes = [line.words[1] for source in [*chain(config, section), section] for line in source.body
             if line.keyword == "mode" and len(line.words) > 1]  # fmt: skip
    return modes[-1] if modes else "tcp"


def servers(config: Config, section: Section) -> Iterator[tuple[int, Flags]]:
    """(line index, flags) of every server of a backend, one per server, templates expanded."""
    flags = Flags()
    for line in [line for defaults in chain(config, section) for line in defaults.body]:
        if line.keyword == "default-server":
            flags = flags_after(flags, line.words[1:])
    for index, line in enumerate(section.body):
        words = line.words
        if line.keyword == "default-server":
            flags = flags_after(flags, words[1:])
        elif line.keyword == "server" and len(words) >= 3:
            yield index, flags_after(flags, words[3:])
        elif line.keyword == "server-template" and len(words) >= 4:
            yield from ((index, flags_after(flags, words[4:])) for _ in template_names(words[1], words[2]))


def settings_of(config: Config, section: Section) -> ProxySettings:
    """What applies to one proxy section, from the one walk over the whole config."""
    return next(settings for proxy, settings in resolve(config.sections) if proxy is section)


def copy(config: Config) -> Config:
    return Config([Section(s.header, list(s.body)) for s in config.sections])


def backends(config: Config) -> list[Section]:
    return [s for s in config.sections if s.kind in BACKEND_KINDS]


def newline_of(line: Line | None) -> str:
    return "\r\n" if line is not None and line.raw.endswith("\r\n") else "\n"


def ended(line: Line) -> Line:
    """The line with a newline, if it was the text's last and had none."""
    return line if line.raw.endswith("\n") else parse_line(line.raw + "\n")


# ---------------------------------------------------------------- the injections


def inject_observe(config: Config, error_limit: int) -> Config:
    result = copy(config)
    suffix = " " + observe_directive(error_limit)
    for section in backends(result):
        flags = servers(result, section)
        wanted = {i for i, f in flags if f.check and not f.backup and f.track is None and not f.observe}
        for index in sorted(wanted):
            section.body[index] = with_appended(section.body[index], suffix)
    return result


def append_after_code(section: Section, words: str) -> None:
    """`words` as a line after the section's last line with words, indented like it (a header
    alone: four spaces), ended like it or, if it has no newline, like the header."""
    last = max((i for i, line in enumerate(section.body) if line.words), default=None)
    if last is None:
        indent, like = "    ", section.header
    else:
        indent, like = section.body[last].indent or "    ", section.body[last]
    if like is not None and not like.raw.endswith("\n"):
        newline = newline_of(section.header) if like is not section.header else "\n"
        fixed = parse_line(like.raw + newline)
        if last is None:
            section.header = fixed
        else:
            section.body[last] = fixed
        like = fixed
    section.body.insert(0 if last is None else last + 1, parse_line(f"{indent}{words}{newline_of(like)}"))


def inject_server_state(config: Config, path: Path) -> Config:
    result = copy(config)
    globals_ = [s for s in result.sections if s.kind == "global"]
    if not any(line.keyword == "server-state-file" for s in globals_ for line in s.body):
        if not globals_:
            globals_ = [Section(parse_line("global\n"))]
            result.sections.insert(1, globals_[0])
        append_after_code(globals_[0], f"server-state-file {quote_word(str(path))}")
    proxies = [s for s in result.sections if s.kind in PROXY_KINDS]
    if any(line.keyword == "load-server-state-from-file" for s in proxies for line in s.body):
        return result
    first_defaults = next((i for i, s in enumerate(result.sections) if s.kind == "defaults"), len(result.sections))
    for i, section in enumerate(result.sections):
        # Every defaults section, and the backends before the first one that inherit nothing.
        alone = section.kind in ("backend", "listen") and i < first_defaults and section.from_defaults is None
        if section.kind == "defaults" or alone:
            append_after_code(section, "load-server-state-from-file global")
    return result


def slot_table_path(config: Config, directory: Path) -> Path:
    """Where the slot table of `config` goes: named by the hash of its text, which lists
    every primary server of every backend, `<backend>_<i> <name>` in config order."""
    rows = [
        f"{section.name}_{i} {name}\n"
        for section, servers in config.servers_by_backend()
        for i, name in enumerate(s.name for s in servers if not s.backup)
    ]
    # Then what cookies and stick entries can name: the home slot of each primary.
    for section, settings in config.each_backend_with_settings():
        all_servers = section_servers(section, settings, config.cache)
        home = {s.name: i for i, s in enumerate(s for s in all_servers if not s.backup)}
        if not home:
            continue
        routing = routing_of(settings, section.body, section.name)
        if routing.cookie:
            first: dict[str, Server] = {}
            for server in all_servers:
                if server.cookie is not None:
                    first.setdefault(server.cookie, server)
            rows += [f"{section.name}/c{value} {home[s.name]}\n" for value, s in first.items() if not s.backup]
        if routing.sticks:
            ids = server_ids([(s.name, s.params) for s in all_servers])
            rows += [f"{section.name}/s{ids[s.name]} {home[s.name]}\n" for s in all_servers if not s.backup]
    return directory / f"slots-{hashlib.sha256(''.join(rows).encode()).hexdigest()[:16]}.map"


# HAProxy runs a backend's request rules in this order whatever order they are written in,
# and warns of one written after a later kind: the guard's go first among its own kind.
_RULE_ORDER = ("tcp-request content", "http-request", "redirect", "use_backend", "use-server")


def rule_kind(line: Line) -> int | None:
    key = " ".join(line.words[:2]) if line.keyword == "tcp-request" else line.keyword
    return _RULE_ORDER.index(key) if key in _RULE_ORDER else None


def above_its_comments(body: list[Line], index: int) -> int:
    while index and not body[index - 1].words and body[index - 1].raw.strip().startswith("#"):
        index -= 1
    return index


def inject_guard(config: Config, map_path: str | Path, table_path: Path) -> Config:
    result = copy(config)
    for section in backends(result):
        body = section.body
        if all(f.backup for _, f in servers(result, section)) or any(x.raw.strip() == GUARD_MARKER for x in body):
            continue
        mode = mode_of(result, section)
        newline = newline_of(section.header)
        if section.header is not None:
            section.header = ended(section.header)
        indent = next((line.indent for line in body if line.words), "") or "    "
        kinds = {i: k for i, line in enumerate(body) if (k := rule_kind(line)) is not None}
        own = _RULE_ORDER.index("http-request" if mode == "http" else "tcp-request content")
        at = min((i for i, k in kinds.items() if k >= own), default=max(kinds, default=-1) + 1)
        use_servers = [i for i, k in kinds.items() if k == _RULE_ORDER.index("use-server")]
        use_at = use_servers[0] if use_servers else max((i + 1 for i in kinds if i >= at), default=at)
        at, use_at = above_its_comments(body, at), above_its_comments(body, use_at)
        settings = settings_of(result, section)
        routing = routing_of(settings, body, section.name)
        rules = [GUARD_MARKER, *guard_redispatch(settings), *guard_rules(mode, str(map_path), str(table_path), routing)]
        use = [guard_use_server()] if use_at == at else [GUARD_MARKER, guard_use_server()]
        body[use_at:use_at] = [parse_line(f"{indent}{text}{newline}") for text in use]
        body[at:at] = [parse_line(f"{indent}{text}{newline}") for text in rules]
    return result


def reference_effective(text: str, settings: Settings) -> tuple[str, Config]:
    """(effective text, effective model) the plain way."""
    # The global policy is no part of the speed-up: the reference takes it as it is.
    config, _ = supervised_global(parse(text), settings.haproxy.master_socket_path)
    table_path = slot_table_path(config, settings.haproxy.runtime_dir)
    if settings.observe.enabled:
        config = inject_observe(config, settings.observe.error_limit)
    if settings.reload.preserve_server_state:
        config = inject_server_state(config, settings.haproxy.server_state_file)
    if settings.old_workers.guard:
        config = inject_guard(config, settings.haproxy.steer_map, table_path)
    return "".join(line.raw for s in config.sections for line in filter(None, (s.header, *s.body))), config
