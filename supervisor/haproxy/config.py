"""The rendered-config model: parse an HAProxy config, edit it, render it back.

The model keeps every line's raw text, so an unmodified parse renders back
byte-identical. Edits (injections) replace or insert whole lines; nothing else
is ever reformatted, which keeps the effective config diffable against the
rendered one.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

# Section keywords known to HAProxy 2.6 - 3.x. Anything inside a section we do not
# model (peers, resolvers, ...) is kept as opaque lines.
SECTION_KEYWORDS = frozenset(
    {
        "global",
        "defaults",
        "frontend",
        "backend",
        "listen",
        "peers",
        "resolvers",
        "userlist",
        "mailers",
        "program",
        "http-errors",
        "ring",
        "cache",
        "fcgi-app",
        "log-forward",
        "crt-store",
        "traces",
        "acme",
    }
)
PROXY_KINDS = frozenset({"frontend", "backend", "listen", "defaults"})
BACKEND_KINDS = frozenset({"backend", "listen"})

# Server keywords that take one argument, in HAProxy 2.6 to 3.x (`source` takes an address,
# then optionally `usesrc <addr>` and `interface <name>`, each read here as a keyword with its
# argument). Knowing them keeps an argument such as `observe layer4` or `track be/check` from
# being read as a flag. tests/test_server_keywords.py holds it to the binary, keyword by keyword.
_SERVER_KEYWORDS_WITH_ARG = frozenset(
    {
        "addr", "agent-addr", "agent-inter", "agent-port", "agent-send", "alpn", "ca-file", "cc",
        "check-alpn", "check-pool-conn-name", "check-proto", "check-sni", "ciphers", "ciphersuites",
        "client-sigalgs", "cookie", "crl-file", "crt", "curves", "downinter", "error-limit", "fall",
        "fastinter", "guid", "hash-key", "healthcheck", "id", "idle-ping", "init-addr", "init-state",
        "inter", "interface", "ktls", "log-bufsize", "log-proto", "max-reuse", "maxconn", "maxqueue",
        "minconn", "namespace", "npn", "observe", "on-error", "on-marked-down", "on-marked-up",
        "pool-conn-name", "pool-low-conn", "pool-max-conn", "pool-purge-delay", "port", "proto",
        "proxy-v2-options", "quic-cc-algo", "redir", "resolve-net", "resolve-opts", "resolve-prefer",
        "resolvers", "rise", "set-proxy-v2-tlv-fmt", "shard", "sigalgs", "slowstart", "sni", "socks4",
        "source", "ssl-max-ver", "ssl-min-ver", "tcp-md5sig", "tcp-ut", "track", "usesrc", "verify",
        "verifyhost", "weight", "ws",
    }
)


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

    def with_appended(self, text: str) -> Line:
        """The same line with `text` added after its last word, before any comment."""
        raw = self.raw[: self.code_end] + text + self.raw[self.code_end :]
        return parse_line(raw)


def parse_line(raw: str) -> Line:
    """Split a line into words the way HAProxy's parser does.

    Whitespace separates words; `#` outside quotes starts a comment; a backslash
    escapes the next character (not inside single quotes); quotes group words
    and are removed. Environment variables are left unexpanded.
    """
    line = _LINES.get(raw)
    if line is None:
        line = _tokenize(raw)
        _LINES.put(raw, line)
    return line


def _tokenize(raw: str) -> Line:
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


_K = TypeVar("_K")
_V = TypeVar("_V")


_ALL_CACHES: list[RecentlyUsed] = []  # for clear_caches()


class RecentlyUsed(Generic[_K, _V]):
    """A dict of what the last two generations used, for results worth keeping from one
    rendered config to the next: consecutive configs share almost all their lines and sections.

    Every Config.parse starts a generation (a new rendered config, in the daemon); what the
    last two did not use is dropped, so each cache holds about two configs' worth.
    """

    __slots__ = ("current", "previous")

    def __init__(self) -> None:
        self.current: dict[_K, _V] = {}
        self.previous: dict[_K, _V] = {}
        _ALL_CACHES.append(self)

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


# A line's text -> its Line (immutable, so configs share them): a parse of the next rendered
# config takes the previous one's Lines instead of splitting 15,000 lines again.
_LINES: RecentlyUsed[str, Line] = RecentlyUsed()


def clear_caches() -> None:
    """Forget every result kept from earlier parses and builds (a cold start: benchmarks)."""
    for cache in _ALL_CACHES:
        cache.new_generation()
        cache.new_generation()
    _apply_params.cache_clear()


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


@dataclass(frozen=True, slots=True)
class Server:
    """A server as a backend sees it, with `default-server` settings applied."""

    backend: str
    name: str
    address: str  # host part, as written (no port), e.g. "127.0.0.1", "::1", "unix@/x"
    port: int | None
    params: tuple[str, ...]  # the server's own parameters, after the address
    check: bool
    backup: bool
    disabled: bool
    observe: bool
    track: str | None
    weight: int | None
    template: bool  # expanded from a server-template line
    line_index: int  # index into the section body of the line that declares it

    @property
    def key(self) -> str:
        return f"{self.backend}/{self.name}"

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}" if self.port is not None else self.address

    @property
    def primary(self) -> bool:
        return not self.backup and self.track is None


def split_address(spec: str) -> tuple[str, int | None]:
    """`127.0.0.1:80` -> ("127.0.0.1", 80); `[::1]:80` -> ("::1", 80); `unix@/s` -> (spec, None)."""
    family = ""
    if "@" in spec:
        family, _, rest = spec.partition("@")
        if family in ("unix", "abns", "sockpair", "fd"):
            return spec, None
        family += "@"
        spec = rest
    if spec.startswith("["):
        host, _, tail = spec[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    elif spec.count(":") == 1:
        host, _, port_text = spec.partition(":")
    elif family == "ipv6@" and ":" in spec:
        host, _, port_text = spec.rpartition(":")
    else:
        host, port_text = spec, ""
    port = int(port_text) if port_text.isdigit() else None
    return family + host if family not in ("", "ipv4@", "ipv6@") else host, port


@functools.lru_cache(maxsize=65536)  # a drain digests a hundred new sections; their hosts repeat
def is_ip(address: str) -> bool:
    """Whether a server's address is an IP address (not a host name resolved at run time)."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


# The words ServerFlags.apply acts on; every other word of a server line is passed over.
_FLAG_WORDS = frozenset(
    {"check", "no-check", "backup", "no-backup", "disabled", "enabled", "observe", "track", "weight"}
)


@dataclass(frozen=True, slots=True)
class ServerFlags:
    """The flags a server line gives its servers, `default-server` settings applied."""

    check: bool = False
    backup: bool = False
    disabled: bool = False
    observe: bool = False
    track: str | None = None
    weight: int | None = None

    def apply(self, params: tuple[str, ...]) -> ServerFlags:
        if not params:
            return self  # most server lines of a big config: no object to make
        return _apply_params(self, params)


# A server line's parameters repeat from server to server (`check inter 2s`), and a call
# walks every word: remember the last few thousand results (pure, and bounded).
@functools.lru_cache(maxsize=4096)
def _apply_params(flags: ServerFlags, params: tuple[str, ...]) -> ServerFlags:
    check, backup, disabled = flags.check, flags.backup, flags.disabled
    observe, track, weight = flags.observe, flags.track, flags.weight
    n = len(params)
    i = 0
    while i < n:
        p = params[i]
        if p in _FLAG_WORDS:
            arg = params[i + 1] if i + 1 < n else None
            if p == "check":
                check = True
            elif p == "no-check":
                check = False
            elif p == "backup":
                backup = True
            elif p == "no-backup":
                backup = False
            elif p == "disabled":
                disabled = True
            elif p == "enabled":
                disabled = False
            elif p == "observe":
                observe = True
            elif p == "track":
                track = arg
            elif p == "weight" and arg is not None and arg.isdigit():
                weight = int(arg)
        if p in _SERVER_KEYWORDS_WITH_ARG:
            i += 1
        i += 1
    return ServerFlags(check, backup, disabled, observe, track, weight)


def _leading_int(text: str) -> int:
    """HAProxy reads these counts with atoi(): leading digits, anything else is 0."""
    digits = len(text) - len(text.lstrip("0123456789"))
    return int(text[:digits]) if digits else 0


def template_names(prefix: str, count: str) -> list[str]:
    """Names a `server-template` line declares: `srv 3` -> srv1..srv3, `srv 2-4` -> srv2..srv4.

    HAProxy accepts junk counts (`x-y` reads as 0-0); they declare no server we can name.
    """
    return [f"{prefix}{i}" for i in _template_numbers(count)]


def _template_numbers(count: str) -> range:
    low, sep, high = count.partition("-")
    if sep:
        first, last = _leading_int(low), _leading_int(high)
    else:
        first, last = 1, _leading_int(low)
    return range(max(first, 1), last + 1)


def _server_lines(body: list[Line], flags: ServerFlags) -> Iterator[tuple[int, Line, ServerFlags]]:
    """Each `server` and `server-template` line of a backend's body that has its address: its
    index, the line, and the flags in force before its own parameters, starting from `flags`
    (its defaults') and applying the backend's own `default-server` lines."""
    for index, line in enumerate(body):
        words = line.words
        if not words:
            continue
        kw = words[0]
        if kw == "default-server":
            flags = flags.apply(words[1:])
        elif (kw == "server" and len(words) >= 3) or (kw == "server-template" and len(words) >= 4):
            yield index, line, flags


def server_line_flags(body: list[Line], defaults_flags: ServerFlags) -> list[tuple[int, ServerFlags]]:
    """(index in the body, the flags its servers get) for each line of `body` that declares servers."""
    lines: list[tuple[int, ServerFlags]] = []
    for index, line, flags in _server_lines(body, defaults_flags):
        words = line.words
        if words[0] == "server":
            lines.append((index, flags.apply(words[3:])))
        elif _template_numbers(words[2]):
            lines.append((index, flags.apply(words[4:])))
    return lines


_NO_FLAGS = ServerFlags()


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What applies to a proxy, resolved the way HAProxy resolves it (cfgparse-listen.c):

    - a proxy starts as a copy of its defaults section: the one it names with `from`, else
      the last `defaults` section before it;
    - a `defaults` section starts as a copy of the one it names with `from`, else from
      HAProxy's built-in defaults: it does NOT inherit from the `defaults` before it;
    - then the section's own lines apply in order, the last one of a keyword winning.

    For a proxy, `server_defaults` holds the `default-server` flags its defaults pass on,
    which its own server lines start from (its own `default-server` lines apply to the
    server lines after them only); for a defaults section, the flags it passes on.
    """

    mode: str = "tcp"
    balance: tuple[str, ...] = ("roundrobin",)  # the words after `balance`
    all_backups: bool = False  # `option allbackups`
    server_defaults: ServerFlags = _NO_FLAGS


_BUILT_IN = ProxySettings()
# The first words of the lines that change a ProxySettings; every other line is passed over.
_SETTING_KEYWORDS = frozenset({"mode", "balance", "option", "no", "default", "default-server"})


def _resolve(base: ProxySettings, body: list[Line], is_defaults: bool) -> ProxySettings:
    """`base` (what the section inherits) with the section's own lines applied."""
    mode, balance, all_backups, flags = base.mode, base.balance, base.all_backups, base.server_defaults
    changed = False
    for line in body:
        words = line.words
        if not words or words[0] not in _SETTING_KEYWORDS:
            continue
        kw = words[0]
        if kw == "mode" and len(words) > 1:
            mode = words[1]
        elif kw == "balance" and len(words) > 1:
            balance = words[1:]
        elif words[-1:] == ("allbackups",) and words[-2:-1] == ("option",):
            # `option allbackups`, `no option allbackups`, `default option allbackups`
            prefix = words[:-2]
            all_backups = True if not prefix else False if prefix == ("no",) else base.all_backups
        elif kw == "default-server" and is_defaults:
            flags = flags.apply(words[1:])
        else:
            continue
        changed = True
    if not changed:
        return base
    return ProxySettings(mode, balance, all_backups, flags)


# (the defaults' flags, a backend body's text) -> _server_line_flags of that body: nothing else
# goes into it, so an edited line or `default-server` gives another key, never a stale entry.
_SERVER_FLAGS: RecentlyUsed[tuple[ServerFlags, str], list[tuple[int, ServerFlags]]] = RecentlyUsed()


class Config:
    """A parsed HAProxy config: the preamble, then one Section per section header."""

    def __init__(self, sections: list[Section]) -> None:
        self.sections = sections

    @classmethod
    def parse(cls, text: str) -> Config:
        _LINES.new_generation()
        _SERVER_FLAGS.new_generation()
        _SECTION_SERVERS.new_generation()
        # _LINES.get, inlined: this loop runs once per line of a 15,000-line config.
        current, previous = _LINES.current, _LINES.previous
        section = Section(None)
        sections = [section]
        body = section.body
        for raw in text.splitlines(keepends=True):
            line = current.get(raw)
            if line is None:
                line = previous.get(raw)
                if line is None:
                    line = _tokenize(raw)
                current[raw] = line
            words = line.words
            if words and words[0] in SECTION_KEYWORDS:
                section = Section(line)
                sections.append(section)
                body = section.body
            else:
                body.append(line)
        return cls(sections)

    def render(self) -> str:
        # One join over every line: a join per section costs more than the lines of 1,000 backends.
        parts: list[str] = []
        for section in self.sections:
            if section.header is not None:
                parts.append(section.header.raw)
            parts.extend([line.raw for line in section.body])
        return "".join(parts)

    def copy(self) -> Config:
        """A copy whose sections can be edited without touching this one (lines are immutable)."""
        return Config([s.copy() for s in self.sections])

    def backends(self) -> Iterator[Section]:
        return (s for s in self.sections if s.kind in BACKEND_KINDS)

    def backend(self, name: str) -> Section | None:
        return next((s for s in self.backends() if s.name == name), None)

    def resolved(self) -> Iterator[tuple[Section, ProxySettings]]:
        """Every defaults, frontend, backend and listen section with its ProxySettings, in
        config order and one pass: `from` chains followed, defaults order as HAProxy reads it."""
        last = _BUILT_IN  # what a proxy without `from` starts from
        named: dict[str, ProxySettings] = {}
        for section in self.sections:
            kind = section.kind
            if kind not in PROXY_KINDS:
                continue
            wanted = section.from_defaults
            is_defaults = kind == "defaults"
            # HAProxy refuses a `from` naming no defaults section before it; the model must
            # not raise on what `haproxy -c` will reject with its own words.
            base = named.get(wanted, _BUILT_IN) if wanted is not None else _BUILT_IN if is_defaults else last
            settings = _resolve(base, section.body, is_defaults)
            if is_defaults:
                last = settings
                if section.name:
                    named[section.name] = settings
            yield section, settings

    def settings_of(self, proxy: Section) -> ProxySettings:
        """What applies to one section (resolved() for a whole config: this walks from the top)."""
        for section, settings in self.resolved():
            if section is proxy:
                return settings
        return _BUILT_IN

    def backends_with_settings(self) -> list[tuple[Section, ProxySettings]]:
        """Each backend/listen section with its ProxySettings, in one pass."""
        return [(s, settings) for s, settings in self.resolved() if s.kind in BACKEND_KINDS]

    def servers(self, backend: Section | None = None) -> list[Server]:
        """Every server of every backend (or of one), in config order, templates expanded."""
        if backend is not None:
            return section_servers(backend, self.settings_of(backend))
        return [server for _, servers in self.servers_by_backend() for server in servers]

    def servers_by_backend(self) -> list[tuple[Section, list[Server]]]:
        """Each backend/listen section with its servers, resolving defaults in one pass."""
        return [(section, section_servers(section, settings)) for section, settings in self.backends_with_settings()]

    def server_map(self) -> dict[str, Server]:
        """Servers keyed by "backend/name"."""
        return {s.key: s for s in self.servers()}

    def server_flags_by_backend(self) -> list[tuple[Section, list[tuple[int, ServerFlags]]]]:
        """Each backend/listen section with, for each line that declares servers, the line's
        index in the body and the flags all its servers get: what servers_by_backend() tells
        about flags, without making a Server for each of 10,000 servers."""
        result: list[tuple[Section, list[tuple[int, ServerFlags]]]] = []
        for section, settings in self.backends_with_settings():
            flags = settings.server_defaults
            key = (flags, "".join([line.raw for line in section.body]))
            lines = _SERVER_FLAGS.get(key)
            if lines is None:
                lines = server_line_flags(section.body, flags)
                _SERVER_FLAGS.put(key, lines)
            result.append((section, list(lines)))
        return result

    def mode_of(self, proxy: Section) -> str:
        """`http` or `tcp` (HAProxy's default), as resolved by settings_of()."""
        return self.settings_of(proxy).mode

    def global_setting(self, keyword: str) -> Line | None:
        for section in self.sections:
            if section.kind == "global":
                for line in section.body:
                    if line.keyword == keyword:
                        return line
        return None


# (a backend's name, what applies to it, its body's text) -> its servers. Nothing else goes
# into them, and a Server is immutable: consecutive configs share the servers of every
# section they share, instead of making 10,000 again at each reload.
_SECTION_SERVERS: RecentlyUsed[tuple[str, ProxySettings, str], tuple[Server, ...]] = RecentlyUsed()


def section_servers(section: Section, settings: ProxySettings) -> list[Server]:
    """The servers of a backend/listen section that `settings` (Config.resolved()'s) apply to."""
    key = (section.name, settings, "".join([line.raw for line in section.body]))
    servers = _SECTION_SERVERS.get(key)
    if servers is None:
        servers = tuple(_section_servers(section.name, section.body, settings))
        _SECTION_SERVERS.put(key, servers)
    return list(servers)


def _section_servers(backend: str, body: list[Line], settings: ProxySettings) -> Iterator[Server]:
    for index, line, flags in _server_lines(body, settings.server_defaults):
        words = line.words
        if words[0] == "server":
            yield _server(backend, words[1], words[2], words[3:], flags, False, index)
        else:
            params = words[4:]
            for name in template_names(words[1], words[2]):
                yield _server(backend, name, words[3], params, flags, True, index)


def _server(
    backend: str,
    name: str,
    address: str,
    params: tuple[str, ...],
    defaults: ServerFlags,
    template: bool,
    index: int,
) -> Server:
    host, port = split_address(address)
    f = defaults.apply(params)
    return Server(
        backend=backend,
        name=name,
        address=host,
        port=port,
        params=params,
        check=f.check,
        backup=f.backup,
        disabled=f.disabled,
        observe=f.observe,
        track=f.track,
        weight=f.weight,
        template=template,
        line_index=index,
    )
