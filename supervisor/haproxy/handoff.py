"""The hand-off: an old worker, without checks or runtime changes, sends a backend's requests
to the current worker through `_hs_current`, a unix socket only it listens on, when the hand-off
map (filled in old workers only) names the backend; there the frontend `_hs_handoff` takes them
to the backend named in a header (docs/steering.md, "Hand-off")."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from .answers import HANDOFF_SERVER, validate_name
from .config import Config
from .guard import GUARD_MARKER, above_comments, is_guarded, primary_names
from .lexer import Line, Section, Slot, body_key, parse_line
from .resolution import BACKEND_KINDS, BUILT_IN, RULE_KEYWORDS, ProxySettings, resolve, server_line_flags

HANDOFF_FRONTEND = "_hs_handoff"
HANDOFF_HEADER = "x-hs-backend"
HANDOFF_VAR = "txn.hs_backend"
HANDOFF_MARKER = "# haproxy-supervisor hand-off"
RESERVED_NAMES = frozenset({HANDOFF_SERVER, HANDOFF_FRONTEND})
# Rules of a section's own would run in both workers; a `use-server` may read a variable left behind.
OWN_RULES = RULE_KEYWORDS | {"use-server"}
# None of what a `default-server` line may give (checks, TLS, backup) holds for the local socket.
_SERVER_WORDS = "weight 0 no-check no-ssl no-backup no-send-proxy send-proxy-v2"
# A path goes inside a converter argument and a bind line: `,`, `)`, blanks and quotes would break it.
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./-]+$")


def map_path(runtime_dir: Path) -> Path:
    return runtime_dir / "handoff.map"


def socket_path(runtime_dir: Path) -> Path:
    return runtime_dir / "handoff.sock"


# (what applies to a backend, its body's key) -> whether it is eligible.
ELIGIBLE: Slot[tuple[ProxySettings, bytes], bool] = Slot("hand-off eligibility")


def eligible_backends(config: Config) -> list[str]:
    """The backends (of `config` before the guard) an old worker may hand off: `mode http`, not
    barred, eligible; none when the hand-off frontend would inherit a bar itself."""
    kept = config.cache.kept(ELIGIBLE)
    names = []
    last_defaults = BUILT_IN  # what the hand-off frontend, placed last, inherits
    for section, settings in resolve(config.sections):
        if section.kind == "defaults":
            last_defaults = settings
        if section.kind not in BACKEND_KINDS or settings.mode != "http" or _bars_the_hand_off(settings):
            continue
        if kept.get_or_make((settings, body_key(section.body)), _eligible, section.body, settings):
            names.append(section.name)
    return [] if _bars_the_hand_off(last_defaults) else names


def _bars_the_hand_off(settings: ProxySettings) -> bool:
    """A header the current worker would add again, or defaults' rules (they run in both workers)."""
    return settings.adds_headers or settings.defaults_rules


def _eligible(body: list[Line], settings: ProxySettings) -> bool:
    """None of OWN_RULES, no server spoken to in HTTP/2 (`proto h2`), and primary servers."""
    if any(line.words and line.words[0] in OWN_RULES for line in body):
        return False
    # The hop speaks HTTP/1; what a backend speaks HTTP/2 to (gRPC: trailers) stays with it.
    server_words = [line.words for line in body if line.words[:1] in _SERVER_KEYWORDS]
    if any(_speaks_h2(words) for words in (*server_words, settings.server_default_words)):
        return False
    return bool(primary_names(body, server_line_flags(body, settings.server_defaults)))


_SERVER_KEYWORDS = frozenset({("server",), ("server-template",), ("default-server",)})


def _speaks_h2(words: tuple[str, ...]) -> bool:
    return any(word == "proto" and following == "h2" for word, following in itertools.pairwise(words))


def reserved_names_used(config: Config) -> list[str]:
    text = config.render()
    if not any(name in text for name in RESERVED_NAMES):
        return []  # most configs: one look at the text instead of at every line's words
    used = {s.name for s in config.sections if s.name in RESERVED_NAMES}
    for section in config.backends():
        used.update(w[1] for line in section.body if len(w := line.words) > 1 and w[:2] == ("server", HANDOFF_SERVER))
    return sorted(used)


def inject_handoff(config: Config, names: Iterable[str], runtime_dir: Path) -> Config:
    """`config` with the hand-off in the backends named and its frontend last (the same config
    when none is); ValueError for a runtime_dir no bind line or map() can name."""
    wanted = set(names)
    if not wanted:
        return config
    path, socket = str(map_path(runtime_dir)), str(socket_path(runtime_dir))
    for text in (path, socket):
        if not _SAFE_PATH.match(text):
            raise ValueError(f"path {text!r}: only letters, digits and _ . / - can go into a map() argument")
    test = f"{{ be_name,map({path}) -m found }}"
    result = config.copy()
    kept = config.cache.kept(HANDED_OFF_BODIES)
    for section, settings in result.each_backend_with_settings():
        if section.name in wanted:
            key = ("".join([b.raw for b in section.body]), settings.retry_on, test, socket)
            body = kept.get_or_make(key, _handed_off_body, section, settings.retry_on, test, socket, result.cache.line)
            section.body = list(body)
    _end_with_newline(result)
    frontend = Config.parse(
        f"frontend {HANDOFF_FRONTEND}\n"
        f"    mode http\n"
        f"    bind unix@{socket} accept-proxy mode 600\n"
        f"    http-request set-var({HANDOFF_VAR}) req.hdr({HANDOFF_HEADER})\n"
        f"    http-request del-header {HANDOFF_HEADER}\n"
        f"    use_backend %[var({HANDOFF_VAR})]\n",
        result.cache,
    )
    result.sections.extend(frontend.sections)
    return result


# (a backend's body's text, its `retry-on`, the hand-off test, the socket) -> the body with the hand-off in it.
HANDED_OFF_BODIES: Slot[tuple[str, tuple[str, ...], str, str], tuple[Line, ...]] = Slot("hand-off bodies")
# `retry-on` words under which a request the current worker closed unanswered is sent again.
_RETRIES_UNANSWERED = frozenset({"empty-response", "all-retryable-errors"})


def rescue_lines(retry_on: tuple[str, ...], test: str) -> list[str]:
    """What retries a handed-off request the current worker ended unanswered on `_hs_current`
    (`force-persist`: redispatch would pick the old worker's frozen servers); `empty-response`
    makes the close a retry in the old worker only; none under `retry-on none`."""
    lines = [f"force-persist if {test}"]
    if "none" not in retry_on and not _RETRIES_UNANSWERED & set(retry_on):
        lines += [f"retry-on {' '.join(retry_on)} empty-response", f"http-request disable-l7-retry unless {test}"]
    return lines


def _handed_off_body(
    section: Section, retry_on: tuple[str, ...], test: str, socket: str, parse: Callable[[str], Line]
) -> tuple[Line, ...]:
    body = list(section.body)
    indent = next((line.indent for line in body if line.words), "") or "    "
    newline = "\r\n" if body and body[-1].raw.endswith("\r\n") else "\n"

    def line(text: str) -> Line:
        return parse(f"{indent}{text}{newline}")

    if is_guarded(section):
        # The guard's refusal (the section has no rule of its own): the current worker has servers.
        refusal = ("http-request", "return", "status", "503")
        body = [parse(f"{b.raw.rstrip()} !{test}{newline}") if b.words[:4] == refusal else b for b in body]
    if body and not body[-1].raw.endswith("\n"):
        body[-1] = parse_line(body[-1].raw + newline)
    first = next((i for i, b in enumerate(body) if _is_rule(b) or b.raw.strip() == GUARD_MARKER), len(body))
    rules_at = above_comments(body, first)
    rules = [f"http-request set-header {HANDOFF_HEADER} %[be_name] if {test}", *rescue_lines(retry_on, test)]
    body[rules_at:rules_at] = [line(HANDOFF_MARKER), *map(line, rules)]
    use_at = next((i for i, b in enumerate(body) if b.words[:1] == ("use-server",)), None)
    # First of the `use-server` rules, else right after the marker and the rules.
    use_at = rules_at + 1 + len(rules) if use_at is None else above_comments(body, use_at)
    body.insert(use_at, line(f"use-server {HANDOFF_SERVER} if {test}"))
    body.append(line(f"server {HANDOFF_SERVER} unix@{socket} {_SERVER_WORDS}"))
    return tuple(body)


def _is_rule(line: Line) -> bool:
    return bool(line.words) and line.words[0] in (*OWN_RULES, "use_backend", "redirect")


def _end_with_newline(config: Config) -> None:
    """The file's last line gets its newline before a section goes after it."""
    last = config.sections[-1] if config.sections else None
    if last is None:
        return
    if last.body and not last.body[-1].raw.endswith("\n"):
        last.body[-1] = parse_line(last.body[-1].raw + "\n")
    elif not last.body and last.header is not None and not last.header.raw.endswith("\n"):
        last.header = parse_line(last.header.raw + "\n")


def is_handed_off(section: Section) -> bool:
    return any(line.words[:2] == ("server", HANDOFF_SERVER) for line in section.body)


def offered(config: Config) -> dict[str, str]:
    """Each backend `config` hands off, by its name (one no CLI line could carry left out), with its mode."""
    found = {}
    for section, settings in config.each_backend_with_settings():
        if is_handed_off(section):
            try:
                found[validate_name("backend", section.name)] = settings.mode
            except ValueError:
                continue
    return found


def accepted(config: Config) -> dict[str, str]:
    """Each backend's mode by name a current worker takes in; none without the hand-off frontend."""
    if not any(s.kind == "frontend" and s.name == HANDOFF_FRONTEND for s in config.sections):
        return {}
    return {section.name: settings.mode for section, settings in config.each_backend_with_settings()}


def handed_off(offers: dict[str, str], accepts: dict[str, str]) -> list[str]:
    """The backends an old worker offers that the current worker has in the same mode."""
    return [name for name, mode in offers.items() if accepts.get(name) == mode]


def handoff_entries(backends: Iterable[str]) -> dict[str, str]:
    return {backend: "1" for backend in backends}
