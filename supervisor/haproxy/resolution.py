"""What applies to each proxy (ProxySettings, by `from` chains and defaults order) and server
(ServerFlags and Server, by `default-server` lines and its own words), as HAProxy resolves it."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .answers import HANDOFF_SERVER, ServerKey
from .lexer import ConfigCache, Line, Section, Slot, body_key

PROXY_KINDS = frozenset({"frontend", "backend", "listen", "defaults"})
BACKEND_KINDS = frozenset({"backend", "listen"})

# Server keywords that take one argument in HAProxy 2.6 to 3.x, so that an argument (`observe
# layer4`, `track be/check`) is not read as a flag; tests/test_server_keywords.py checks each.
SERVER_KEYWORDS_WITH_ARG = frozenset(
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
    # Made once: server_map() and the steering look it up for every server.
    key: ServerKey = field(init=False, repr=False, compare=False)
    cookie: str | None = None  # its `cookie` value, its own or from `default-server`

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", ServerKey.of(self.backend, self.name))

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}" if self.port is not None else self.address


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


def same_host(a: str, b: str) -> bool:
    """Equal IP addresses (`::1`, `0::1`), or one name in any case."""
    if a == b:
        return True  # the usual case, without parsing either
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()


def _kept_hash(value: ServerFlags | ProxySettings) -> int:
    # Kept once made: these key the parse caches, looked up for every backend at every build.
    kept = value._hash
    if kept is None:
        kept = hash(value.compared())
        object.__setattr__(value, "_hash", kept)
    return kept


# The words ServerFlags.apply acts on that switch a flag: the flag, and its new value.
_SWITCHES = {
    "check": ("check", True), "no-check": ("check", False), "backup": ("backup", True), "no-backup": ("backup", False),
    "disabled": ("disabled", True), "enabled": ("disabled", False), "observe": ("observe", True),
}
_FLAG_FIELDS = ("check", "backup", "disabled", "observe", "track", "weight", "cookie")


@dataclass(frozen=True, slots=True)
class ServerFlags:
    """The flags a server line gives its servers, `default-server` settings applied."""

    check: bool = False
    backup: bool = False
    disabled: bool = False
    observe: bool = False
    track: str | None = None
    weight: int | None = None
    cookie: str | None = None
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def compared(self) -> tuple[object, ...]:
        """Its fields, as its __eq__ compares them."""
        return (self.check, self.backup, self.disabled, self.observe, self.track, self.weight, self.cookie)

    def __hash__(self) -> int:
        return _kept_hash(self)

    def apply(self, params: tuple[str, ...]) -> ServerFlags:
        if not params:
            return self  # most server lines of a big config: no object to make
        return _apply_params(self, params)


# A server line's parameters repeat from server to server (`check inter 2s`).
@functools.lru_cache(maxsize=4096)
def _apply_params(flags: ServerFlags, params: tuple[str, ...]) -> ServerFlags:
    fields = dict(zip(_FLAG_FIELDS, flags.compared(), strict=True))
    n = len(params)
    i = 0
    while i < n:
        p = params[i]
        if p in _SWITCHES:
            name, value = _SWITCHES[p]
            fields[name] = value
        elif p in ("track", "weight", "cookie"):
            arg = params[i + 1] if i + 1 < n else None
            if p == "track" or (p == "cookie" and arg is not None):
                fields[p] = arg
            elif p == "weight" and arg is not None and arg.isdigit():
                fields["weight"] = int(arg)
        if p in SERVER_KEYWORDS_WITH_ARG:
            i += 1
        i += 1
    return ServerFlags(**fields)


def _leading_int(text: str) -> int:
    """HAProxy reads these counts with atoi(): leading digits, anything else is 0."""
    digits = len(text) - len(text.lstrip("0123456789"))
    return int(text[:digits]) if digits else 0


def template_names(prefix: str, count: str) -> list[str]:
    """`srv 3` -> srv1..srv3, `srv 2-4` -> srv2..srv4; a junk count (`x-y`: 0-0) names none."""
    return [f"{prefix}{i}" for i in _template_numbers(count)]


def _template_numbers(count: str) -> range:
    low, sep, high = count.partition("-")
    if sep:
        first, last = _leading_int(low), _leading_int(high)
    else:
        first, last = 1, _leading_int(low)
    return range(max(first, 1), last + 1)


def _server_lines(body: list[Line], flags: ServerFlags) -> Iterator[tuple[int, Line, ServerFlags]]:
    """Each `server` and `server-template` line with its address, its index, and the flags
    before its own words (`flags`, then the `default-server` lines)."""
    for index, line in enumerate(body):
        words = line.words
        if not words:
            continue
        kw = words[0]
        if kw == "default-server":
            flags = flags.apply(words[1:])
        elif (kw == "server" and len(words) >= 3 and words[1] != HANDOFF_SERVER) or (
            kw == "server-template" and len(words) >= 4
        ):
            yield index, line, flags


def server_line_flags(body: list[Line], defaults_flags: ServerFlags) -> list[tuple[int, ServerFlags]]:
    """(index in the body, its servers' flags) for each line of `body` that declares servers."""
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
    """What applies to a proxy (cfgparse-listen.c): a copy of the defaults it names with `from`,
    else of the last `defaults` before it (for a `defaults`: of the built-in ones), then its own
    lines in order. `server_defaults`: the `default-server` flags its defaults pass on; their
    words, which a dynamic server must be given: `server_default_words`."""

    mode: str = "tcp"
    balance: tuple[str, ...] = ("roundrobin",)  # the words after `balance`
    all_backups: bool = False  # `option allbackups`
    server_defaults: ServerFlags = _NO_FLAGS
    server_default_words: tuple[str, ...] = ()
    cookie: tuple[str, ...] = ()  # the words after `cookie` (persistence), if any
    hash_type: tuple[str, ...] = ()  # the words after `hash-type`; none: map-based sdbm
    # Some `option redispatch` line applies: the guard leaves retries as the config says.
    redispatch_said: bool = False
    # `option forwardfor`, `option originalto` or `unique-id-header` (none can be negated).
    adds_headers: bool = False
    retry_on: tuple[str, ...] = ("conn-failure",)  # the words after `retry-on`
    # Its (named) defaults define TCP/HTTP rules: HAProxy refuses a frontend and a backend under them.
    defaults_rules: bool = False
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def compared(self) -> tuple[object, ...]:
        """Its fields, as its __eq__ compares them and its constructor takes them."""
        return (self.mode, self.balance, self.all_backups, self.server_defaults, self.server_default_words,
                self.cookie, self.hash_type, self.redispatch_said, self.adds_headers, self.retry_on,
                self.defaults_rules)

    def __hash__(self) -> int:
        return _kept_hash(self)


BUILT_IN = ProxySettings()
RULE_KEYWORDS = frozenset({"http-request", "http-response", "http-after-response", "tcp-request", "tcp-response"})
# The first words of the lines that change a ProxySettings; every other line is passed over.
_SETTING_KEYWORDS = frozenset({
    "mode", "balance", "option", "no", "default", "default-server", "cookie", "hash-type", "retry-on",
    "unique-id-header", *RULE_KEYWORDS,
})


def _resolve(base: ProxySettings, body: list[Line], is_defaults: bool) -> ProxySettings:
    """`base` (what the section inherits) with the section's own lines applied."""
    mode, balance, all_backups, flags = base.mode, base.balance, base.all_backups, base.server_defaults
    default_words = base.server_default_words
    cookie, hash_type = base.cookie, base.hash_type
    redispatch_said, adds_headers, retry_on = base.redispatch_said, base.adds_headers, base.retry_on
    defaults_rules = base.defaults_rules
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
        elif _says_redispatch(words):
            redispatch_said = True
        elif words[:2] in (("option", "forwardfor"), ("option", "originalto")) or kw == "unique-id-header":
            adds_headers = True
        elif kw == "default-server" and is_defaults:
            flags = flags.apply(words[1:])
            default_words += words[1:]
        elif kw == "cookie" and len(words) > 1:
            cookie = words[1:]
        elif kw == "hash-type" and len(words) > 1:
            hash_type = words[1:]
        elif kw == "retry-on" and len(words) > 1:
            retry_on = words[1:]
        elif kw in RULE_KEYWORDS:
            if not is_defaults:
                continue
            defaults_rules = True
        else:
            continue
        changed = True
    # The same object when nothing differs: the caches keyed by it compare it by identity.
    settings = (
        mode, balance, all_backups, flags, default_words, cookie, hash_type, redispatch_said, adds_headers, retry_on,
        defaults_rules,
    )
    if not changed or settings == base.compared():
        return base
    return ProxySettings(*settings)


def _says_redispatch(words: tuple[str, ...]) -> bool:
    """`option redispatch [n]`, with `no` or `default` before it or not."""
    at = 1 if words[0] in ("no", "default") else 0
    return words[at:at + 2] == ("option", "redispatch")


def resolve(sections: Iterable[Section]) -> Iterator[tuple[Section, ProxySettings]]:
    """Every proxy and defaults section with its ProxySettings, in config order and one pass."""
    last = BUILT_IN  # what a proxy without `from` starts from
    named: dict[str, ProxySettings] = {}
    for section in sections:
        kind = section.kind
        if kind not in PROXY_KINDS:
            continue
        wanted = section.from_defaults
        is_defaults = kind == "defaults"
        # A `from` naming no defaults before it: `haproxy -c` rejects it, the model must not raise.
        base = named.get(wanted, BUILT_IN) if wanted is not None else BUILT_IN if is_defaults else last
        settings = _resolve(base, section.body, is_defaults)
        if is_defaults:
            last = settings
            if section.name:
                named[section.name] = settings
        yield section, settings


# (a backend's name, what applies to it, its body's key) -> its servers.
SECTION_SERVERS: Slot[tuple[str, ProxySettings, bytes], tuple[Server, ...]] = Slot("section servers")


def section_servers(section: Section, settings: ProxySettings, cache: ConfigCache) -> list[Server]:
    """The servers of a backend that `settings` apply to, shared through `cache` by consecutive configs."""
    key = (section.name, settings, body_key(section.body))
    return list(cache.kept(SECTION_SERVERS).get_or_make(key, _section_servers, section.name, section.body, settings))


def _section_servers(backend: str, body: list[Line], settings: ProxySettings) -> tuple[Server, ...]:
    servers: list[Server] = []
    for index, line, flags in _server_lines(body, settings.server_defaults):
        words = line.words
        template = words[0] == "server-template"
        names = template_names(words[1], words[2]) if template else [words[1]]
        address, params = (words[3], words[4:]) if template else (words[2], words[3:])
        host, port = split_address(address)
        f = flags.apply(params)
        for name in names:
            servers.append(Server(
                backend=backend, name=name, address=host, port=port, params=params, check=f.check, backup=f.backup,
                disabled=f.disabled, observe=f.observe, track=f.track, weight=f.weight, template=template,
                line_index=index, cookie=f.cookie,
            ))
    return tuple(servers)
