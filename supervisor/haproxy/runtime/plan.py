"""The plan: the runtime changes from the running config to the new one (addresses, ports,
weights, enabled state, servers added and removed), or why a reload is needed. A dynamic server
gets no `default-server` settings, so `add server` carries them (`resolved_params`); what it
refuses, HAProxy's answer tells the applier (docs/runtime-changes.md)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ..answers import ServerKey, ServerState
from ..config import Config, Section
from ..guard import COOKIE_ROW, SLOT_TABLE_PREFIX, STICK_ROW, persistence_rows, slot_table
from ..resolution import (
    BACKEND_KINDS,
    SERVER_KEYWORDS_WITH_ARG,
    Server,
    is_ip,
    same_host,
    section_servers,
    split_address,
)
from ..routing import effective_weight

# Flags a fresh dynamic server starts without: `no-<flag>` after nothing that set it says
# nothing, and `add server` refuses some of these negations (`no-check`).
_OFF_BY_DEFAULT = frozenset(
    {"check", "backup", "agent-check", "send-proxy", "send-proxy-v2", "ssl", "check-ssl", "check-send-proxy", "tfo"}
)
_SLOT_TABLE_NAME = re.compile(re.escape(SLOT_TABLE_PREFIX) + r"[0-9a-f]+\.map")
_ANY_SLOT_TABLE = f"{SLOT_TABLE_PREFIX}*.map"

Words = tuple[str, ...]
# A server present in both configs: (its old section, old server, new section, new server).
Pair = tuple[Section, Server, Section, Server]


@dataclass(frozen=True, slots=True)
class ServerAdd:
    """A server to add in maint; then its checks enabled, then `state ready` unless disabled."""

    backend: str
    server: str
    address: str  # as written in the config (an IP literal and a port)
    params: tuple[str, ...]  # resolved: default-server words, then its own; no enabled/disabled
    check: bool
    agent: bool
    enabled: bool

    def __post_init__(self) -> None:
        ServerKey.checked(self.backend, self.server)
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


def resolved_params(words: Iterable[str]) -> tuple[str, ...]:
    """Server words folded for `add server`: each keyword once at its last value, `no-X` cancels
    an earlier X, `enabled`/`disabled` left out."""
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
    skeleton: Words  # the line without what the Runtime API sets in place
    context: tuple[Words, ...]  # the backend's default-server lines before it


def _server_lines(section: Section) -> dict[str, _ServerLine] | str:
    lines: dict[str, _ServerLine] = {}
    context: list[Words] = []
    for line in section.body:
        words = line.words
        if words[:1] == ("default-server",):
            context.append(words)
        elif words[:1] == ("server",) and len(words) >= 3:
            if words[1] in lines:
                return f"{section.kind} {section.name}: two servers named {words[1]}"
            lines[words[1]] = _ServerLine(_without_runtime_fields(words), tuple(context))
    return lines


def membership(running: Config, new: Config) -> tuple[list[Pair], list[ServerAdd], list[ServerKey]] | str:
    """The servers in both configs, those added and those removed, or why the change is more:
    everything but `server` lines (and the slot table's name) must be the same, and a server in
    both the same line but for what the Runtime API sets, after the same `default-server` lines."""
    old_frame, new_frame = config_skeleton(running, frame=True), config_skeleton(new, frame=True)
    if old_frame != new_frame:
        return _first_difference(old_frame, new_frame)
    pairs: list[Pair] = []
    adds: list[ServerAdd] = []
    removes: list[ServerKey] = []
    old_backends, new_backends = running.each_backend_with_settings(), new.each_backend_with_settings()
    for (old_section, old_settings), (new_section, new_settings) in zip(old_backends, new_backends, strict=True):
        old_lines, new_lines = _server_lines(old_section), _server_lines(new_section)
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
                return f"{where}: {_first_difference([before.skeleton], [after.skeleton])}"
        old_servers = section_servers(old_section, old_settings, running.cache)
        new_servers = section_servers(new_section, new_settings, new.cache)
        old_templates = [s for s in old_servers if s.template]
        new_templates = [s for s in new_servers if s.template]
        pairs += [(old_section, o, new_section, n) for o, n in zip(old_templates, new_templates, strict=True)]
        by_name = {s.name: s for s in old_servers if not s.template}
        pairs += [
            (old_section, by_name[s.name], new_section, s) for s in new_servers if not s.template and s.name in by_name
        ]
        for server in new_servers:
            if server.template or server.name in old_lines:
                continue
            added = _add_of(new_section, server, new_settings.server_default_words, new_lines[server.name].context)
            if isinstance(added, str):
                return added
            adds.append(added)
        removes.extend(ServerKey.checked(old_section.name, name) for name in old_lines if name not in new_lines)
    return pairs, adds, removes


def _add_of(section: Section, server: Server, inherited: Words, context: tuple[Words, ...]) -> ServerAdd | str:
    """The add of `server`, after the `default-server` words of its defaults (`inherited`) and backend (`context`)."""
    words = section.body[server.line_index].words
    params = resolved_params([*inherited, *(w for line in context for w in line[1:]), *words[3:]])
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
        )
    except ValueError as exc:
        return str(exc)


def slot_map_commands(path: str, held: dict[str, str], config: Config, backends: set[str]) -> list[str]:
    """The map commands that make a worker's slot table (`held`) what `config` gives `backends`:
    set/add for new and changed slots and persistence rows, then del for those gone."""
    wanted = {f"{backend}_{i}": name for backend, names in slot_table(config) if backend in backends
              for i, name in enumerate(names)}
    persistence = tuple(f"{b}{row}" for b in backends for row in (COOKIE_ROW, STICK_ROW))
    wanted |= {
        key: slot for key, slot in persistence_rows(config)
        if key.startswith(persistence) and not any(c in key for c in ";\\ \t")
    }
    prefixes = tuple(f"{b}_" for b in backends)
    commands = [f"{'set' if key in held else 'add'} map {path} {key} {value}"
                for key, value in wanted.items() if held.get(key) != value]
    commands += [
        f"del map {path} {key}" for key in held if key not in wanted and key.startswith(prefixes)
        and key[key.rindex("_") + 1:].isdigit() and key[: key.rindex("_")] in backends
    ]
    commands += [f"del map {path} {key}" for key in held if key not in wanted and key.startswith(persistence)]
    return commands


# `show map` (no file) lists each map a process loaded as `<id> (<path>) pattern loaded from file ...`.
_LISTED_SLOT_TABLE = re.compile(rf"^-?\d+ \((/(?:[A-Za-z0-9_./-]*/)?{_SLOT_TABLE_NAME.pattern})\) ", re.M)


def loaded_slot_table(show_map: str) -> str | None:
    found = _LISTED_SLOT_TABLE.search(show_map)
    return found[1] if found else None


MAX_WEIGHT = 256  # HAProxy's absolute weight range is 0..256
DEFAULT_WEIGHT = 1

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")


def _validate_address(address: str) -> None:
    """An IPv4 or IPv6 literal, or a host name (letters, digits, `-` and `.`), else ValueError."""
    if not is_ip(address) and not _HOSTNAME.match(address):
        raise ValueError(f"invalid server address {address!r}: not an IP address or a host name")


def _validate_int(kind: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"invalid server {kind} {value!r}: must be an integer from {low} to {high}")


@dataclass(frozen=True, slots=True)
class ServerChange:

    backend: str
    server: str
    from_address: str
    from_port: int | None
    to_address: str
    to_port: int | None
    from_weight: int = DEFAULT_WEIGHT
    to_weight: int = DEFAULT_WEIGHT
    was_enabled: bool = True
    enabled: bool = True

    def __post_init__(self) -> None:
        ServerKey.checked(self.backend, self.server)
        _validate_address(self.from_address)
        _validate_address(self.to_address)
        for port in (self.from_port, self.to_port):
            if port is not None:
                _validate_int("port", port, 1, 65535)
        _validate_int("weight", self.from_weight, 0, MAX_WEIGHT)
        _validate_int("weight", self.to_weight, 0, MAX_WEIGHT)
        if self.address_changed and self.to_port is None and self.from_port is not None:
            raise ValueError(f"{self.key}: cannot drop the port of a server at runtime")

    @property
    def key(self) -> ServerKey:
        return ServerKey.of(self.backend, self.server)

    @property
    def address_changed(self) -> bool:
        return self.from_port != self.to_port or not same_host(self.from_address, self.to_address)

    @property
    def weight_changed(self) -> bool:
        return self.from_weight != self.to_weight

    @property
    def takes_out(self) -> bool:
        """A disable: the server leaves service."""
        return self.was_enabled and not self.enabled


def ordered_commands(change: ServerChange) -> list[str]:
    """The commands for one change, in the one order that never routes wrongly: a disable starts
    with `state maint`, an enable ends with `state ready`, a live server's address is swapped in
    place (maint/ready would empty a backend of one). A refusal stops the sequence."""
    target = change.key
    weight = [f"set server {target} weight {change.to_weight}"] if change.weight_changed else []
    port = f" port {change.to_port}" if change.to_port is not None else ""
    addr = f"set server {target} addr {change.to_address}{port}"
    if not change.address_changed and not change.takes_out:
        if change.enabled and not change.was_enabled:
            # Still in maint from the config's `disabled`: weight first, ready last.
            return [*weight, f"set server {target} state ready"]
        return weight
    if not change.takes_out and change.was_enabled:
        return [addr, *weight]
    # An enable whose address changes starts with `state maint` too: a refused address leaves
    # it in maint, never ready at the wrong address.
    commands = [f"set server {target} state maint"]
    if change.address_changed:
        commands.append(addr)
    commands += weight
    if change.enabled:
        commands.append(f"set server {target} state ready")
    return commands


def _runtime_endpoint(word: str) -> tuple[str, int | None] | None:
    """(host, port) of an address `set server ... addr` can take (an IP literal), else None."""
    family = ""
    if word.startswith(("ipv4@", "ipv6@")):
        family, word = word[:4], word[5:]
    host: str
    port_text: str | None
    if word.startswith("["):
        host, sep, tail = word[1:].partition("]")
        if not sep or (tail and not tail.startswith(":")):
            return None
        port_text = tail[1:] if tail else None
    elif family == "ipv6":
        host, _, port_text = word.rpartition(":")
    elif word.count(":") == 1:
        host, _, port_text = word.partition(":")
    elif ":" not in word:
        host, port_text = word, None
    else:
        return None  # bare IPv6: HAProxy reads the last group as a port; too easy to misread
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if (family == "ipv4" and ip.version != 4) or (family == "ipv6" and ip.version != 6):
        return None
    if port_text is None:
        return str(ip), None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return str(ip), int(port_text)


def _address_index(line_words: Words) -> int:
    return 3 if line_words[0] == "server-template" else 2


def _without_runtime_fields(words: Words) -> Words:
    """A server line's words with the address, `disabled`/`enabled` and `weight N` taken out."""
    at = _address_index(words)
    kept = [*words[:at], "<address>"]
    params = words[at + 1 :]
    i = 0
    while i < len(params):
        word = params[i]
        if word in ("disabled", "enabled"):
            i += 1
            continue
        if word == "weight":
            i += 2
            continue
        kept.append(word)
        if word in SERVER_KEYWORDS_WITH_ARG and i + 1 < len(params):
            kept.append(params[i + 1])
            i += 1
        i += 1
    return tuple(kept)


def _is_server_line(section: Section, words: Words) -> bool:
    if section.kind not in BACKEND_KINDS or not words:
        return False
    return (words[0] == "server" and len(words) >= 3) or (words[0] == "server-template" and len(words) >= 4)


def config_skeleton(config: Config, frame: bool = False) -> list[Words]:
    """Every line's words, without comments or server runtime fields: configs with the same
    skeleton differ only in what the Runtime API sets. `frame`: without `server` lines and with
    a generic slot table name (membership())."""
    skeleton: list[Words] = []
    for section in config.sections:
        if section.header is not None:
            skeleton.append(("<section>", *section.header.words))
        for line in section.body:
            words = line.words
            if not words:
                continue
            if _is_server_line(section, words):
                if frame and words[0] == "server":
                    continue
                words = _without_runtime_fields(words)
            if frame:
                words = tuple(_SLOT_TABLE_NAME.sub(_ANY_SLOT_TABLE, w) for w in words)
            skeleton.append(words)
    return skeleton


@dataclass(frozen=True, slots=True)
class RuntimePlan:
    """The runtime changes from one config to another, or (changes None) why only a reload can."""

    changes: list[ServerChange] | None
    why_reload: str = ""
    adds: tuple[ServerAdd, ...] = ()
    removes: tuple[ServerKey, ...] = ()  # checked
    # Adds the worker holds already (a daemon was killed mid-change): only readied.
    present: tuple[ServerAdd, ...] = ()

    @property
    def membership_changes(self) -> bool:
        return bool(self.adds or self.removes or self.present)

    @property
    def backends(self) -> set[str]:
        return {a.backend for a in (*self.adds, *self.present)} | {key.backend for key in self.removes}


def completed_plan(plan: RuntimePlan, held: list[ServerState], new: Config) -> RuntimePlan | str:
    """The plan against what the worker holds, for a change a killed daemon left half made
    (docs/removals.md): an add held at its address is `present`, elsewhere a reload (why); a
    removal not held is done, and a held server neither config has is removed too."""
    holds = {s.key: s for s in held}
    adds: list[ServerAdd] = []
    present: list[ServerAdd] = list(plan.present)
    for add in plan.adds:
        state = holds.get(add.key)
        if state is None:
            adds.append(add)
        elif (state.address, state.port) == split_address(add.address):
            present.append(add)
        else:
            return f"{add.key}: the worker holds it at {state.address}:{state.port}, not {add.address}"
    removes = [key for key in plan.removes if key in holds]
    wanted = set(new.server_map()) | set(removes)
    removes += [ServerKey.checked(s.backend, s.name) for s in held if s.key not in wanted]
    return replace(plan, adds=tuple(adds), removes=tuple(removes), present=tuple(present))


def runtime_plan(running: Config, new: Config) -> RuntimePlan:
    adds: list[ServerAdd] = []
    removes: list[ServerKey] = []
    if config_skeleton(running) != config_skeleton(new):
        found = membership(running, new)
        if isinstance(found, str):
            return RuntimePlan(None, found)
        pairs, adds, removes = found
    else:
        pairs = []
        for (old_section, old_servers), (new_section, new_servers) in zip(
            running.servers_by_backend(), new.servers_by_backend(), strict=True
        ):
            if [s.name for s in old_servers] != [s.name for s in new_servers]:
                # The same skeleton cannot give other names; refuse rather than guess.
                return RuntimePlan(None, f"{new_section.kind} {new_section.name}: its servers differ")
            pairs += [(old_section, o, new_section, n) for o, n in zip(old_servers, new_servers, strict=True)]
    changes: list[ServerChange] = []
    for old_section, old, new_section, fresh in pairs:
        change = _server_change(old_section, old, new_section, fresh)
        if isinstance(change, str):
            return RuntimePlan(None, change)
        if change is not None:
            changes.append(change)
    return RuntimePlan(changes, "", tuple(adds), tuple(removes))


def _first_difference(old: list[Words], new: list[Words]) -> str:
    """Where two skeletons first differ: a line gone, new, or changed (by whether the lines after it line up again)."""
    index = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    lacks = index >= len(new) or (index < len(old) and old[index + 1 : index + 2] == new[index : index + 1])
    adds = not lacks and (index >= len(old) or new[index + 1 : index + 2] == old[index : index + 1])
    skeleton, what = (old, " is gone") if lacks else (new, " is new" if adds else "")
    line = skeleton[index]
    section = next((s for s in reversed(skeleton[: index + 1]) if s[:1] == ("<section>",)), None)
    where = f"{' '.join(section[1:3])}: " if section is not None and section is not line else ""
    text = " ".join(line[1:] if line[:1] == ("<section>",) else line)
    if len(text) > 120:
        text = text[:117] + "..."
    return f"{where}`{text}`{what or ' differs beyond what the Runtime API sets'}"


def _server_change(old_section: Section, old: Server, new_section: Section, new: Server) -> ServerChange | str | None:
    """The change for one server; None when it does not change; why, when it needs a reload."""
    old_words = old_section.body[old.line_index].words
    new_words = new_section.body[new.line_index].words
    old_word = old_words[_address_index(old_words)]
    new_word = new_words[_address_index(new_words)]
    if old_word == new_word:
        old_endpoint = new_endpoint = (old.address, old.port)
    else:
        parsed_old, parsed_new = _runtime_endpoint(old_word), _runtime_endpoint(new_word)
        if parsed_old is None or parsed_new is None:
            unset = new_word if parsed_new is None else old_word
            return f"{new.key}: address {unset} cannot be set at runtime (an IP literal and a port can)"
        if (parsed_old[1] is None) != (parsed_new[1] is None):
            return f"{new.key}: a port cannot be added to or dropped from a server at runtime"
        old_endpoint, new_endpoint = parsed_old, parsed_new
    if old_word == new_word and old.disabled == new.disabled and effective_weight(old) == effective_weight(new):
        return None
    try:
        change = ServerChange(
            backend=old.backend,
            server=old.name,
            from_address=old_endpoint[0],
            from_port=old_endpoint[1],
            to_address=new_endpoint[0],
            to_port=new_endpoint[1],
            from_weight=effective_weight(old),
            to_weight=effective_weight(new),
            was_enabled=not old.disabled,
            enabled=not new.disabled,
        )
    except ValueError as exc:
        return str(exc)
    if not change.address_changed and not change.weight_changed and change.was_enabled == change.enabled:
        return None  # the address was only spelled differently
    return change


def _is_subsequence(short: list[Words], long: list[Words]) -> bool:
    rest = iter(long)
    return all(any(line == other for other in rest) for line in short)


def transient_render(running: Config, new: Config) -> str | None:
    """Why `new` looks like a render caught mid-rebuild (Ray Serve redeploying an app), or None: a
    reload would be needed, `new`'s lines are all in `running` in order, and a backend kept with
    its routes lost every primary."""
    primaries = {section.name: [s for s in servers if not s.backup] for section, servers in new.servers_by_backend()}
    emptied = [section.name for section, servers in running.servers_by_backend()
               if any(not s.backup for s in servers) and primaries.get(section.name) == []]
    if not emptied or not _is_subsequence(config_skeleton(new), config_skeleton(running)):
        return None
    plan = runtime_plan(running, new)
    if plan.changes is not None:
        return None
    return f"{', '.join(emptied)} lost every primary server and only lines were taken out ({plan.why_reload})"
