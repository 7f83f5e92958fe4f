"""Names that reach HAProxy's CLI: checked before they go on a line, and the key that names
a server everywhere (`<backend>/<server>`, as the CLI writes it)."""

from __future__ import annotations

import re

# Names that reach the CLI must not be able to smuggle a second command or argument.
_SAFE_NAME = re.compile(r"\A[A-Za-z0-9_.:\-]+\Z")  # \Z: "$" would let a trailing newline through


def validate_name(kind: str, name: str) -> str:
    """A backend, server, map key or value that may go on a CLI line, or ValueError."""
    if not _SAFE_NAME.match(name):
        raise ValueError(f"invalid {kind} name {name!r}: only letters, digits and _ . : - are allowed")
    return name


class ServerKey(str):
    """A server as the CLI names it, `<backend>/<server>`: the key of every server map and set.
    A str (its text form), so it is a dict key and compares equal to that text. of() takes
    names HAProxy already holds (a parsed config or answer); checked() and parse() take
    names that are to reach the CLI, and raise ValueError for one that could not."""

    __slots__ = ()

    @classmethod
    def of(cls, backend: str, server: str) -> ServerKey:
        return cls(f"{backend}/{server}")

    @classmethod
    def checked(cls, backend: str, server: str) -> ServerKey:
        return cls(f"{validate_name('backend', backend)}/{validate_name('server', server)}")

    @classmethod
    def parse(cls, text: str) -> ServerKey:
        """`<backend>/<server>`, both names checked."""
        backend, sep, server = text.partition("/")
        if not sep:
            raise ValueError(f"invalid server key {text!r}: expected backend/server")
        return cls.checked(backend, server)

    @property
    def backend(self) -> str:
        return self.partition("/")[0]

    @property
    def server(self) -> str:
        return self.partition("/")[2]
