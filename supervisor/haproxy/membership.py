"""Servers added and removed by name, planned for the Runtime API (pure; runtime/apply.py applies).

A replica that moves gets a new server name (Ray Serve names each server after its replica),
so a rolling deployment adds and removes `server` lines and changes nothing else. HAProxy
2.6 and later can do that at runtime (`add server`, `del server`), so such a change needs no
reload and leaves no old worker. It qualifies when, section by section, everything but the
`server` lines of backends is unchanged (comments, spacing and the name of the slot table the
guard reads aside), and every server present in both has the same line apart from what the
Runtime API sets in place (address, weight, enabled) and the same `default-server` lines
before it.

A dynamic server gets none of the `default-server` settings (checked on 2.6.12: a backend's
`default-server weight 7` came out as weight 1), so its `add server` line carries what the
config resolves for it: the `default-server` words of its defaults section (through `from`
chains), then those of its backend before its line, then its own, each keyword once with its
last value. `add server` refuses some keywords (`cookie`, `init-addr`, `no-check`, ...) and
some backends (`balance static-rr`): the applier judges by HAProxy's answer and reloads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .answers import ServerKey, parse_map_list, validate_name
from .config import Config, Section
from .guard import COOKIE_ROW, SLOT_TABLE_PREFIX, STICK_ROW, persistence_rows, slot_table
from .resolution import BACKEND_KINDS, SERVER_KEYWORDS_WITH_ARG, Server, is_ip, section_servers

# Flags a fresh dynamic server starts without: `no-<flag>` after nothing that set it says
# nothing, and `add server` refuses some of these negations (`no-check`).
_OFF_BY_DEFAULT = frozenset(
    {"check", "backup", "agent-check", "send-proxy", "send-proxy-v2", "ssl", "check-ssl", "check-send-proxy", "tfo"}
)
_SLOT_TABLE_NAME = re.compile(re.escape(SLOT_TABLE_PREFIX) + r"[0-9a-f]+\.map")
_ANY_SLOT_TABLE = f"{SLOT_TABLE_PREFIX}*.map"

Words = tuple[str, ...]
Skeleton = Callable[[Words], Words]  # a server line without what the Runtime API sets in place
Difference = Callable[[list[Words], list[Words]], str]  # where two skeletons differ, for the log


@dataclass(frozen=True, slots=True)
class ServerAdd:
    """A server to add: `add server <backend>/<server> <address> <params>`, in maint; then
    health (and agent) checks enabled, then `state ready` unless its config disables it."""

    backend: str
    server: str
    address: str  # as written in the config (an IP literal and a port)
    params: tuple[str, ...]  # resolved: default-server words, then its own; no enabled/disabled
    check: bool
    agent: bool
    enabled: bool
    primary: bool

    def __post_init__(self) -> None:
        validate_name("backend", self.backend)
        validate_name("server", self.server)
        for word in (self.address, *self.params):
            if not word or any(c in word for c in ";\n\r\t #"):
                raise ValueError(f"{self.key}: `{word}` cannot go on a CLI line")

    @property
    def key(self) -> ServerKey:
        return ServerKey.of(self.backend, self.server)

    @property
    def add_command(self) -> str:
        return " ".join(["add server", self.key, self.address, *self.params])

    @property
    def ready_commands(self) -> list[str]:
        """What follows the add, in order: checks first, `state ready` last."""
        commands = [f"enable health {self.key}"] if self.check else []
        if self.agent:
            commands.append(f"enable agent {self.key}")
        if self.enabled:
            commands.append(f"set server {self.key} state ready")
        return commands


@dataclass(frozen=True, slots=True)
class ServerRemove:
    backend: str
    server: str

    def __post_init__(self) -> None:
        validate_name("backend", self.backend)
        validate_name("server", self.server)

    @property
    def key(self) -> ServerKey:
        return ServerKey.of(self.backend, self.server)


def resolved_params(words: Iterable[str]) -> tuple[str, ...]:
    """Server words as HAProxy applies them in order, folded into one line for `add server`:
    each keyword once, at its last value; `no-X` cancels an earlier X; `enabled`/`disabled`
    left out (the applier readies a server or not)."""
    items: dict[str, tuple[str, ...]] = {}
    seq = list(words)
    i = 0
    while i < len(seq):
        word = seq[i]
        if word in SERVER_KEYWORDS_WITH_ARG and i + 1 < len(seq):
            items.pop(word, None)
            items[word] = (word, seq[i + 1])
            i += 2
            continue
        i += 1
        if word in ("enabled", "disabled"):
            continue
        if word.startswith("no-"):
            positive = word[3:]
            if positive in items or positive in _OFF_BY_DEFAULT:
                items.pop(positive, None)
                continue
        items.pop(f"no-{word}", None)
        items[word] = (word,)
    return tuple(w for item in items.values() for w in item)


@dataclass(frozen=True, slots=True)
class _ServerLine:
    name: str
    skeleton: tuple[str, ...]  # the line without what the Runtime API sets in place
    context: tuple[tuple[str, ...], ...]  # the backend's default-server lines before it


def _frame(config: Config, skeleton_of: Skeleton) -> list[Words]:
    """Every line's words but backends' `server` lines, the slot table's name made generic."""
    frame: list[tuple[str, ...]] = []
    for section in config.sections:
        if section.header is not None:
            frame.append(("<section>", *section.header.words))
        for line in section.body:
            words = line.words
            if not words:
                continue
            if section.kind in BACKEND_KINDS:
                if words[0] == "server" and len(words) >= 3:
                    continue
                if words[0] == "server-template" and len(words) >= 4:
                    words = skeleton_of(words)
            frame.append(tuple(_SLOT_TABLE_NAME.sub(_ANY_SLOT_TABLE, w) for w in words))
    return frame


def _server_lines(section: Section, skeleton_of: Skeleton) -> dict[str, _ServerLine] | str:
    lines: dict[str, _ServerLine] = {}
    context: list[tuple[str, ...]] = []
    for line in section.body:
        words = line.words
        if words[:1] == ("default-server",):
            context.append(words)
        elif words[:1] == ("server",) and len(words) >= 3:
            if words[1] in lines:
                return f"{section.kind} {section.name}: two servers named {words[1]}"
            lines[words[1]] = _ServerLine(words[1], skeleton_of(words), tuple(context))
    return lines


@dataclass(frozen=True, slots=True)
class Membership:
    """What a change adds and removes, and the backends whose servers change (in-place
    changes of the servers present in both are planned by runtime/plan.py, as before)."""

    adds: tuple[ServerAdd, ...]
    removes: tuple[ServerRemove, ...]
    common: tuple[tuple[Section, Section, list[tuple[Server, Server]]], ...]

    @property
    def backends(self) -> set[str]:
        return {c.backend for c in self.adds} | {c.backend for c in self.removes}


def membership(running: Config, new: Config, skeleton_of: Skeleton, first_difference: Difference) -> Membership | str:
    """The servers added and removed between two configs, or why the change is more than that."""
    old_frame, new_frame = _frame(running, skeleton_of), _frame(new, skeleton_of)
    if old_frame != new_frame:
        return first_difference(old_frame, new_frame)
    adds: list[ServerAdd] = []
    removes: list[ServerRemove] = []
    common: list[tuple[Section, Section, list[tuple[Server, Server]]]] = []
    old_backends = running.backends_with_settings()
    new_backends = new.backends_with_settings()
    for (old_section, old_settings), (new_section, new_settings) in zip(old_backends, new_backends, strict=True):
        old_lines, new_lines = _server_lines(old_section, skeleton_of), _server_lines(new_section, skeleton_of)
        if isinstance(old_lines, str):
            return old_lines
        if isinstance(new_lines, str):
            return new_lines
        where = f"{new_section.kind} {new_section.name}"
        kept = [name for name in old_lines if name in new_lines]
        if kept != [name for name in new_lines if name in old_lines]:
            return f"{where}: its servers are in another order"
        for name in kept:
            before, after = old_lines[name], new_lines[name]
            if before.context != after.context:
                return f"{where}: the default-server lines before `server {name}` differ"
            if before.skeleton != after.skeleton:
                return f"{where}: {first_difference([before.skeleton], [after.skeleton])}"
        old_servers = {s.name: s for s in section_servers(old_section, old_settings, running.cache) if not s.template}
        new_servers = section_servers(new_section, new_settings, new.cache)
        pairs = [(old_servers[s.name], s) for s in new_servers if not s.template and s.name in old_lines]
        templates = [(o, n) for o, n in zip(
            [s for s in section_servers(old_section, old_settings, running.cache) if s.template],
            [s for s in new_servers if s.template], strict=True)]
        common.append((old_section, new_section, templates + pairs))
        for server in new_servers:
            if server.template or server.name in old_lines:
                continue
            added = _add_of(new_section, server, new_settings.server_default_words)
            if isinstance(added, str):
                return added
            adds.append(added)
        removes.extend(ServerRemove(old_section.name, name) for name in old_lines if name not in new_lines)
    return Membership(tuple(adds), tuple(removes), tuple(common))


def _add_of(section: Section, server: Server, inherited: tuple[str, ...]) -> ServerAdd | str:
    words = section.body[server.line_index].words
    own_defaults: list[str] = []
    for line in section.body[: server.line_index]:
        if line.words[:1] == ("default-server",):
            own_defaults.extend(line.words[1:])
    params = resolved_params([*inherited, *own_defaults, *words[3:]])
    if server.port is None or not is_ip(server.address):
        return f"{server.key}: address {words[2]} cannot be added at runtime (an IP literal and a port can)"
    try:
        return ServerAdd(
            backend=server.backend,
            server=server.name,
            address=words[2],
            params=params,
            check=server.check,
            agent="agent-check" in params,
            enabled=not server.disabled,
            primary=not server.backup,
        )
    except ValueError as exc:
        return str(exc)


def slot_map_commands(path: str, held: dict[str, str], config: Config, backends: set[str]) -> list[str]:
    """The map commands that make a worker's slot table (`held`, read with `show map`) what
    `config` gives `backends`: `set map` / `add map` for new and changed slots and
    persistence rows (a cookie's or a stick entry's home slot moves with its server), then
    `del map` for those that are gone."""
    wanted = {
        f"{backend}_{i}": name
        for backend, names in slot_table(config)
        if backend in backends
        for i, name in enumerate(names)
    }
    persistence = tuple(f"{b}{row}" for b in backends for row in (COOKIE_ROW, STICK_ROW))
    wanted |= {
        key: slot for key, slot in persistence_rows(config)
        if key.startswith(persistence) and not any(c in key for c in ";\\ \t")
    }
    prefixes = tuple(f"{b}_" for b in backends)
    commands = [
        f"{'set' if key in held else 'add'} map {path} {key} {value}"
        for key, value in wanted.items()
        if held.get(key) != value
    ]
    commands += [
        f"del map {path} {key}" for key in held if key not in wanted and key.startswith(prefixes)
        and key[key.rindex("_") + 1:].isdigit() and key[: key.rindex("_")] in backends
    ]
    commands += [f"del map {path} {key}" for key in held if key not in wanted and key.startswith(persistence)]
    return commands


def loaded_slot_table(show_map: str) -> str | None:
    """The slot table file a worker loaded, from its `show map` list."""
    tables = [path for path in parse_map_list(show_map) if _SLOT_TABLE_NAME.fullmatch(path.rsplit("/", 1)[-1])]
    return tables[0] if tables else None
