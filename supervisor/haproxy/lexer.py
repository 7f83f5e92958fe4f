"""The lexer of HAProxy configs: one physical line into its words, as HAProxy splits them, and
a section as its header line and body."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


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
        """The same line with `text` added after its last word, before any comment. `parse`:
        what makes the new line (a ConfigCache's `line`, to share it), parse_line if None."""
        raw = self.raw[: self.code_end] + text + self.raw[self.code_end :]
        return (parse or parse_line)(raw)


def parse_line(raw: str) -> Line:
    """Split a line into words the way HAProxy's parser does.

    Whitespace separates words; `#` outside quotes starts a comment; a backslash
    escapes the next character (not inside single quotes); quotes group words
    and are removed. Environment variables are left unexpanded.
    """
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


def quote_word(word: str) -> str:
    """Quote a word for a config line, if it needs it."""
    if word and not any(c in word for c in " \t#\"'\\"):
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
        if self.header is None:
            return None
        words = self.header.words
        for i, w in enumerate(words[:-1]):
            if w == "from" and i >= 1:
                return words[i + 1]
        return None

    def lines(self) -> Iterator[Line]:
        if self.header is not None:
            yield self.header
        yield from self.body

    def render(self) -> str:
        return "".join(line.raw for line in self.lines())

    def copy(self) -> Section:
        return Section(self.header, list(self.body))
