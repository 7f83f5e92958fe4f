"""HAProxy config lines split into words as HAProxy splits them, sections, and `ConfigCache`:
what consecutive configs share. A cached value is immutable and keyed by all it depends on, so a
hit is never stale; each layer names what it keeps with a Slot of its own."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar


@dataclass(frozen=True, slots=True)
class Line:
    """One physical line. `raw` includes its newline (absent on a last line without one)."""

    raw: str
    words: tuple[str, ...]
    code_end: int  # offset in raw where the code ends: before trailing blanks, comment, newline

    @property
    def keyword(self) -> str:
        return self.words[0] if self.words else ""

    @property
    def indent(self) -> str:
        return self.raw[: len(self.raw) - len(self.raw.lstrip(" \t"))]

    def with_appended(self, text: str, parse: Callable[[str], Line] | None = None) -> Line:
        """The same line with `text` after its last word, before any comment, made by `parse`."""
        raw = self.raw[: self.code_end] + text + self.raw[self.code_end :]
        return (parse or parse_line)(raw)


# What HAProxy's parser takes for blanks between words (isspace(), but \r and \n end a line):
# seen on 2.6.12, 2.8.25 and 3.0.11, which split at \v and \f, and not at \xa0 or \x1f.
BLANKS = " \t\v\f"


def parse_line(raw: str) -> Line:
    """Split a line into words the way HAProxy's parser does: BLANKS separate words, `#` outside
    quotes starts a comment, a backslash escapes the next character (not inside single quotes),
    quotes group words and are removed. Environment variables are left unexpanded."""
    body = raw.rstrip("\r\n")
    # str.split() splits an ASCII line at exactly BLANKS but for \r and \x1c-\x1f: a line with
    # one of those, a quote or an escape takes the walk below.
    if (body.isascii() and "\\" not in body and '"' not in body and "'" not in body and "\r" not in body
            and "\x1c" not in body and "\x1d" not in body and "\x1e" not in body and "\x1f" not in body):
        code = body.split("#", 1)[0]
        stripped = code.rstrip(BLANKS)
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
        if not quote:
            if c in BLANKS:
                if in_word:
                    words.append("".join(current))
                    current = []
                    in_word = False
                i += 1
                continue
            if c == "#":
                break
            in_word = True
        if c == quote:
            quote = ""
        elif not quote and c in "\"'":
            quote = c
        elif c == "\\" and quote != "'" and i + 1 < n:
            i += 1
            current.append(body[i])
        else:
            current.append(c)
        i += 1
        code_end = i
    if in_word or quote:
        words.append("".join(current))
    return Line(raw, tuple(words), code_end)


def quote_word(word: str) -> str:
    if word and not any(c in word for c in BLANKS + "#\"'\\"):
        return word
    return "'" + word.replace("'", "'\\''") + "'"


@dataclass(slots=True)
class Section:
    """A section: its header line (None for the preamble before the first) and body."""

    header: Line | None
    body: list[Line] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.header.keyword if self.header else ""

    @property
    def name(self) -> str:
        if self.header is None or len(self.header.words) < 2:
            return ""
        second = self.header.words[1]
        # `defaults from x` has no name; every other section's name is its first argument.
        return "" if self.kind == "defaults" and second == "from" else second

    @property
    def from_defaults(self) -> str | None:
        """The named defaults section a proxy inherits from (`from NAME`), if any."""
        words = self.header.words if self.header is not None else ()
        return next((words[i + 1] for i in range(1, len(words) - 1) if words[i] == "from"), None)

    def copy(self) -> Section:
        return Section(self.header, list(self.body))


_K = TypeVar("_K")
_V = TypeVar("_V")


def content_key(text: str) -> bytes:
    """What a cache of things made from `text` keys them by: a 128-bit BLAKE2b digest, so the
    cache holds 16 bytes where a copy of the text would hold a whole config's worth."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def body_key(lines: Iterable[Line]) -> bytes:
    return content_key("".join([line.raw for line in lines]))


class RecentlyUsed(Generic[_K, _V]):
    """A dict of what the last two generations used: about two configs' worth."""

    __slots__ = ("current", "previous")

    def __init__(self) -> None:
        self.current: dict[_K, _V] = {}
        self.previous: dict[_K, _V] = {}

    def new_generation(self) -> None:
        self.previous, self.current = self.current, {}

    def get_or_make(self, key: _K, make: Callable[..., _V], *args: Any) -> _V:
        """The value kept for `key`, else make(*args)'s, kept from now on."""
        value = self.current.get(key)
        if value is None:
            value = self.previous.get(key)
            if value is None:
                value = make(*args)
            self.current[key] = value
        return value


class Slot(Generic[_K, _V]):
    """The name of one RecentlyUsed in every ConfigCache, typed with what it keeps."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class ConfigCache:
    """What a config's parse and build keep for the next config's, held by each Config parsed
    with it. Its owner calls new_generation() before it parses the next rendered config."""

    __slots__ = ("_kept", "lines")

    def __init__(self) -> None:
        # A line's text -> its Line: the next config's parse takes it instead of splitting it again.
        self.lines: RecentlyUsed[str, Line] = RecentlyUsed()
        self._kept: dict[Slot[Any, Any], RecentlyUsed[Any, Any]] = {}

    def kept(self, slot: Slot[_K, _V]) -> RecentlyUsed[_K, _V]:
        return self._kept.setdefault(slot, RecentlyUsed())

    def new_generation(self) -> None:
        self.lines.new_generation()
        for kept in list(self._kept.values()):
            kept.new_generation()

    def line(self, raw: str) -> Line:
        """parse_line(raw), shared with the configs that hold the same line."""
        return self.lines.get_or_make(raw, parse_line, raw)
