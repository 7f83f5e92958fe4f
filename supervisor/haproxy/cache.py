"""What consecutive configs share: a cache of parse and build results, as an object its
owner passes to Config.parse and starts a generation of for each rendered config.

Consecutive rendered configs share almost all their lines and sections, so a line's words,
a backend's servers and the guard's plan for a backend body are kept from one config to the
next. Every value is immutable and keyed by all it depends on (the text it comes from, what
the section inherits), so a hit is never stale, and a build in a thread that races the
event loop costs a miss at worst.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

from .lexer import Line, parse_line

if TYPE_CHECKING:
    from .config import Chunk
    from .guard import GuardPlan
    from .resolution import ProxySettings, Server, ServerFlags

_K = TypeVar("_K")
_V = TypeVar("_V")


class RecentlyUsed(Generic[_K, _V]):
    """A dict of what the last two generations used: what the last two did not use is dropped
    at each new generation, so it holds about two configs' worth."""

    __slots__ = ("current", "previous")

    def __init__(self) -> None:
        self.current: dict[_K, _V] = {}
        self.previous: dict[_K, _V] = {}

    def new_generation(self) -> None:
        self.previous, self.current = self.current, {}

    def get(self, key: _K) -> _V | None:
        value = self.current.get(key)
        if value is None:
            value = self.previous.get(key)
            if value is not None:
                self.current[key] = value
        return value

    def put(self, key: _K, value: _V) -> None:
        self.current[key] = value


class ConfigCache:
    """The results a config's parse and build keep for the next config's. A Config holds the
    cache it was parsed with (its copies too); one parsed without one gets its own, shared
    with nothing. The owner calls new_generation() before it parses the next rendered config."""

    __slots__ = ("chunks", "guard_plans", "lines", "section_servers", "server_flags")

    def __init__(self) -> None:
        # A line's text -> its Line: a parse of the next rendered config takes the previous
        # one's Lines instead of splitting 15,000 lines again.
        self.lines: RecentlyUsed[str, Line] = RecentlyUsed()
        # A run of whole lines -> its parse (config.py's Chunk): most sections of the next
        # config are the same text, and a lookup of a section is cheaper than one per line.
        self.chunks: RecentlyUsed[str, Chunk] = RecentlyUsed()
        # (the defaults' flags, a backend body's text) -> server_line_flags() of that body.
        self.server_flags: RecentlyUsed[tuple[ServerFlags, str], list[tuple[int, ServerFlags]]] = RecentlyUsed()
        # (a backend's name, what applies to it, its body's text) -> its servers.
        self.section_servers: RecentlyUsed[tuple[str, ProxySettings, str], tuple[Server, ...]] = RecentlyUsed()
        # (what applies to a backend, its name, its body's text) -> where the guard goes in it.
        self.guard_plans: RecentlyUsed[tuple[ProxySettings, str, str], GuardPlan] = RecentlyUsed()

    def new_generation(self) -> None:
        """A new rendered config is about to be parsed: keep what the last two used."""
        for kept in (self.chunks, self.lines, self.server_flags, self.section_servers, self.guard_plans):
            kept.new_generation()

    def line(self, raw: str) -> Line:
        """parse_line(raw), shared with the configs that hold the same line."""
        line = self.lines.get(raw)
        if line is None:
            line = parse_line(raw)
            self.lines.put(raw, line)
        return line
