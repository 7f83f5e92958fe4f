"""The config model: parse, edit by whole lines, render back byte-identical where unedited (the
effective config stays diffable against the rendered one). One edit lives here: `observe`, so a
worker marks a server down by its own traffic, between health checks."""

from __future__ import annotations

import re
from collections.abc import Iterator

from .lexer import ConfigCache, Line, Section, Slot, body_key, content_key, parse_line
from .resolution import (
    BACKEND_KINDS,
    ProxySettings,
    Server,
    ServerFlags,
    resolve,
    section_servers,
    server_line_flags,
)

# Section keywords of HAProxy 2.6 - 3.x; the lines of sections not modelled are kept opaque.
SECTION_KEYWORDS = frozenset(
    {
        "global", "defaults", "frontend", "backend", "listen", "peers", "resolvers", "userlist", "mailers",
        "program", "http-errors", "ring", "cache", "fcgi-app", "log-forward", "crt-store", "traces", "acme",
    }
)


class Config:
    """The preamble, then one Section per header; `cache`: what it keeps for the next config's."""

    def __init__(self, sections: list[Section], cache: ConfigCache | None = None) -> None:
        self.sections = sections
        self.cache = cache if cache is not None else ConfigCache()

    @classmethod
    def parse(cls, text: str, cache: ConfigCache | None = None) -> Config:
        cache = cache if cache is not None else ConfigCache()
        # Whole runs of lines at once: a run seen in the last two parses is one lookup, not one per
        # line. Any line start is a correct cut, so the pattern only has to find usual headers.
        kept = cache.kept(CHUNKS)
        section = Section(None)
        sections = [section]
        start = 0
        for end in [*(m.end() for m in _CHUNK_START.finditer(text)), len(text)]:
            chunk = text[start:end]
            start = end
            lead, headed = kept.get_or_make(content_key(chunk), _parse_chunk, chunk, cache)
            section.body.extend(lead)
            for header, body in headed:
                section = Section(header, list(body))
                sections.append(section)
        return cls(sections, cache)

    def render(self) -> str:
        # One join over every line: a join per section costs more.
        parts: list[str] = []
        for section in self.sections:
            if section.header is not None:
                parts.append(section.header.raw)
            parts.extend([line.raw for line in section.body])
        return "".join(parts)

    def copy(self) -> Config:
        """A copy whose sections can be edited without touching this one (lines are immutable)."""
        return Config([s.copy() for s in self.sections], self.cache)

    def backends(self) -> Iterator[Section]:
        return (s for s in self.sections if s.kind in BACKEND_KINDS)

    def each_backend_with_settings(self) -> Iterator[tuple[Section, ProxySettings]]:
        return ((s, settings) for s, settings in resolve(self.sections) if s.kind in BACKEND_KINDS)

    def servers(self) -> list[Server]:
        """Every server of every backend, in config order, templates expanded."""
        return [server for _, servers in self.servers_by_backend() for server in servers]

    def servers_by_backend(self) -> list[tuple[Section, list[Server]]]:
        cache = self.cache
        return [(s, section_servers(s, settings, cache)) for s, settings in self.each_backend_with_settings()]

    def server_map(self) -> dict[str, Server]:
        return {s.key: s for s in self.servers()}

    def server_flags_by_backend(self) -> list[tuple[Section, list[tuple[int, ServerFlags]]]]:
        """Each backend with (index in the body, flags) of each line declaring servers: no Server made."""
        result: list[tuple[Section, list[tuple[int, ServerFlags]]]] = []
        kept = self.cache.kept(SERVER_FLAGS)
        for section, settings in self.each_backend_with_settings():
            flags = settings.server_defaults
            key = (flags, body_key(section.body))
            lines = kept.get_or_make(key, server_line_flags, section.body, flags)
            result.append((section, list(lines)))
        return result

    def global_setting(self, keyword: str) -> Line | None:
        return next((x for s in self.sections if s.kind == "global" for x in s.body if x.keyword == keyword), None)


def observe_directive(error_limit: int) -> str:
    return f"observe layer4 error-limit {error_limit} on-error mark-down"


def wants_observe(server: Server | ServerFlags) -> bool:
    """Checked primaries not observed yet: `observe` needs `check`, which a `track` server must not
    have, and backups are what a mark-down is meant to reach."""
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


# Where Config.parse cuts a config into runs it caches whole (a header missed makes a run longer).
_CHUNK_START = re.compile(r"\n(?=(?:backend|listen|frontend|defaults)[ \t\r\n#])")

Chunk = tuple[tuple[Line, ...], tuple[tuple[Line, tuple[Line, ...]], ...]]

# A run of whole lines (its content_key) -> its parse.
CHUNKS: Slot[bytes, Chunk] = Slot("chunks")
# (the defaults' flags, a backend body's key) -> server_line_flags() of that body.
SERVER_FLAGS: Slot[tuple[ServerFlags, bytes], list[tuple[int, ServerFlags]]] = Slot("server flags")


def _parse_chunk(text: str, cache: ConfigCache) -> Chunk:
    """A run of whole lines: those before its first header, then each header with its body."""
    # cache.line, inlined: this loop runs once per line.
    current, previous = cache.lines.current, cache.lines.previous
    lead: list[Line] = []
    headed: list[tuple[Line, list[Line]]] = []
    body = lead
    for raw in text.splitlines(keepends=True):
        line = current.get(raw)
        if line is None:
            line = previous.get(raw)
            if line is None:
                line = parse_line(raw)
            current[raw] = line
        words = line.words
        if words and words[0] in SECTION_KEYWORDS:
            body = []
            headed.append((line, body))
        else:
            body.append(line)
    return tuple(lead), tuple((header, tuple(lines)) for header, lines in headed)
