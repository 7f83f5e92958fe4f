"""What consecutive configs share: a cache of parse and build results, as an object its
owner passes to Config.parse and starts a generation of for each rendered config.

Consecutive rendered configs share almost all their lines and sections, so a line's words,
a backend's servers and the guard's plan for a backend body are kept from one config to the
next. Every value is immutable and keyed by all it depends on (the text it comes from, what
the section inherits), so a hit is never stale, and a build in a thread that races the
event loop costs a miss at worst. Each layer names what it keeps with a Slot of its own
(config.py's chunks, resolution.py's servers, guard.py's plans): this, the lowest layer,
knows none of their types.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from .lexer import Line, parse_line

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


class Slot(Generic[_K, _V]):
    """The name of one RecentlyUsed in every ConfigCache: a module-level constant of the layer
    that keeps it, typed with what it keeps."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class ConfigCache:
    """The results a config's parse and build keep for the next config's. A Config holds the
    cache it was parsed with (its copies too); one parsed without one gets its own, shared
    with nothing. The owner calls new_generation() before it parses the next rendered config."""

    __slots__ = ("_kept", "lines")

    def __init__(self) -> None:
        # A line's text -> its Line: a parse of the next rendered config takes the previous
        # one's Lines instead of splitting 15,000 lines again.
        self.lines: RecentlyUsed[str, Line] = RecentlyUsed()
        self._kept: dict[Slot[Any, Any], RecentlyUsed[Any, Any]] = {}

    def kept(self, slot: Slot[_K, _V]) -> RecentlyUsed[_K, _V]:
        """What `slot` keeps: made on first use (a racing thread's first use costs a miss)."""
        found = self._kept.get(slot)
        if found is None:
            found = self._kept.setdefault(slot, RecentlyUsed())
        return found

    def new_generation(self) -> None:
        """A new rendered config is about to be parsed: keep what the last two used."""
        self.lines.new_generation()
        for kept in list(self._kept.values()):
            kept.new_generation()

    def line(self, raw: str) -> Line:
        """parse_line(raw), shared with the configs that hold the same line."""
        line = self.lines.get(raw)
        if line is None:
            line = parse_line(raw)
            self.lines.put(raw, line)
        return line
