"""The plan: does the new config differ from the running one only in what the runtime API can
change (server addresses, ports, weights, enabled state; servers added and removed by name)?
Then the changes; else the one-line reason a reload is needed.

Each change is to one live server, with the order of its commands.

Order of the commands for one server (`ordered_commands`):

- disable: `state maint` first, then the address, then the weight. Once in maint the
  server takes no new request, so what follows cannot route anything.
- enable: the address and the weight while the server is still in maint, `state ready`
  last, so it starts taking requests at the right address with the right weight. When
  the address changes, an explicit `state maint` goes first even though a disabled
  server should already be in maint: if the address is then refused the server is
  known to be in maint, never ready at an address it should not have.
- new address of an enabled server: the address, then the weight, and the server stays
  ready throughout. Requests balanced to it before the command go to the old address,
  after it to the new one (HAProxy closes its idle connections to the old address on
  the change); at no time is it routable at a placeholder, and it never leaves rotation,
  which a maint/ready pair would do and which empties a backend of one server.
- weight alone, address and enabled state unchanged: one `weight` command. Weight only
  shifts the proportion of requests between servers that are all at the right address,
  so no order of it can route wrongly. `weight 0` before a disable buys nothing
  either: `state maint` stops new requests just as well and is what a disable means.

A refused command stops the sequence for that server: what was accepted stays, the
rest is not sent. As `state ready` is always last, a server whose sequence began with
`state maint` stays in maint. The reloader then reloads (the hook answers False).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass, replace

from ..answers import ServerKey, ServerState, validate_name
from ..config import Config, Section
from ..membership import ServerAdd, ServerRemove, membership
from ..resolution import BACKEND_KINDS, SERVER_KEYWORDS_WITH_ARG, Server

MAX_WEIGHT = 256  # HAProxy's absolute weight range is 0..256
DEFAULT_WEIGHT = 1

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")


def validate_address(address: str) -> str:
    """An IPv4 or IPv6 literal, or a host name (letters, digits, `-` and `.`), or ValueError."""
    try:
        ipaddress.ip_address(address)
        return address
    except ValueError:
        pass
    if not _HOSTNAME.match(address):
        raise ValueError(f"invalid server address {address!r}: not an IP address or a host name")
    return address


def validate_port(port: int | None) -> int | None:
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"invalid server port {port!r}: must be an integer from 1 to 65535")
    return port


def validate_weight(weight: int) -> int:
    if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_WEIGHT:
        raise ValueError(f"invalid server weight {weight!r}: must be an integer from 0 to {MAX_WEIGHT}")
    return weight


def _same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()


@dataclass(frozen=True, slots=True)
class ServerChange:
    """What changes on one server that already exists in the running worker."""

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
        validate_name("backend", self.backend)
        validate_name("server", self.server)
        validate_address(self.from_address)
        validate_address(self.to_address)
        validate_port(self.from_port)
        validate_port(self.to_port)
        validate_weight(self.from_weight)
        validate_weight(self.to_weight)
        if self.address_changed and self.to_port is None and self.from_port is not None:
            raise ValueError(f"{self.key}: cannot drop the port of a server at runtime")

    @property
    def key(self) -> ServerKey:
        return ServerKey.of(self.backend, self.server)

    @property
    def address_changed(self) -> bool:
        return self.from_port != self.to_port or not _same_host(self.from_address, self.to_address)

    @property
    def weight_changed(self) -> bool:
        return self.from_weight != self.to_weight


def ordered_commands(change: ServerChange) -> list[str]:
    """The CLI commands for one change, in the only order that never routes wrongly (module doc)."""
    target = change.key
    weight = [f"set server {target} weight {change.to_weight}"] if change.weight_changed else []
    disabling = change.was_enabled and not change.enabled
    if not change.address_changed and not disabling:
        if change.enabled and not change.was_enabled:
            # Still in maint from the config's `disabled`: weight first, ready last.
            return [*weight, f"set server {target} state ready"]
        return weight
    if not disabling and change.was_enabled:
        # A live server's new address: swapped in place, never out of rotation (module doc).
        port = f" port {change.to_port}" if change.to_port is not None else ""
        return [f"set server {target} addr {change.to_address}{port}", *weight]
    commands = [f"set server {target} state maint"]
    if change.address_changed:
        port = f" port {change.to_port}" if change.to_port is not None else ""
        commands.append(f"set server {target} addr {change.to_address}{port}")
    commands += weight
    if change.enabled:
        commands.append(f"set server {target} state ready")
    return commands


log = logging.getLogger(__package__)


def _runtime_endpoint(word: str) -> tuple[str, int | None] | None:
    """(host, port) of a config address that `set server ... addr` can express, else None.

    Only IP literals: `set server addr` does no DNS resolution, and a host name, a port
    range or offset (`+1000`), a unix socket or a family prefix other than ipv4@/ipv6@
    means the change is for a reload to make.
    """
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


def _address_index(line_words: tuple[str, ...]) -> int:
    return 3 if line_words[0] == "server-template" else 2


def _without_runtime_fields(words: tuple[str, ...]) -> tuple[str, ...]:
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


def _is_server_line(section: Section, words: tuple[str, ...]) -> bool:
    if section.kind not in BACKEND_KINDS or not words:
        return False
    return (words[0] == "server" and len(words) >= 3) or (words[0] == "server-template" and len(words) >= 4)


def config_skeleton(config: Config) -> list[tuple[str, ...]]:
    """Every line's words, blank and comment lines left out, server runtime fields taken out.

    Two configs with the same skeleton differ only in what the Runtime API can set on
    servers that exist in both, or in comments and spacing, which HAProxy never sees.
    """
    skeleton: list[tuple[str, ...]] = []
    for section in config.sections:
        if section.header is not None:
            skeleton.append(("<section>", *section.header.words))
        for line in section.body:
            if not line.words:
                continue
            skeleton.append(_without_runtime_fields(line.words) if _is_server_line(section, line.words) else line.words)
    return skeleton


def _weight(server: Server) -> int:
    return DEFAULT_WEIGHT if server.weight is None else server.weight


@dataclass(frozen=True, slots=True)
class RuntimePlan:
    """The runtime changes that turn one config into another, or (changes None) why only a
    reload can: one line, for the log. `adds` and `removes`: servers added and removed by
    name (membership.py), around the in-place `changes` of the servers present in both."""

    changes: list[ServerChange] | None
    why_reload: str = ""
    adds: tuple[ServerAdd, ...] = ()
    removes: tuple[ServerRemove, ...] = ()
    # Adds the worker already holds (a daemon killed in the middle of this change): only
    # their checks and `state ready` are sent.
    present: tuple[ServerAdd, ...] = ()

    @property
    def membership_changes(self) -> bool:
        return bool(self.adds or self.removes or self.present)

    @property
    def backends(self) -> set[str]:
        return {a.backend for a in (*self.adds, *self.present)} | {r.backend for r in self.removes}


def _endpoint(address: str) -> tuple[str, int | None]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address, None
    return host.strip("[]"), int(port)


def completed_plan(plan: RuntimePlan, held: list[ServerState], new: Config) -> RuntimePlan | str:
    """The plan against what the worker holds (`show servers state` of the plan's backends),
    rather than what its generation's model says: the part of the change that a daemon killed
    in the middle of it made is not made twice. An add the worker holds at the same address is
    `present` (only readied); one it holds elsewhere means a reload; a removal it no longer
    holds is done; a server it holds in those backends that neither the running model (the
    removes) nor `new` has is removed too (a removal left pending by that daemon). Why not, as
    a string."""
    holds = {s.key: s for s in held}
    adds: list[ServerAdd] = []
    present: list[ServerAdd] = list(plan.present)
    for add in plan.adds:
        state = holds.get(add.key)
        if state is None:
            adds.append(add)
        elif (state.address, state.port) == _endpoint(add.address):
            present.append(add)
        else:
            return f"{add.key}: the worker holds it at {state.address}:{state.port}, not {add.address}"
    removes = [r for r in plan.removes if r.key in holds]
    wanted = set(new.server_map()) | {r.key for r in removes}
    removes += [ServerRemove(s.backend, s.name) for s in held if s.key not in wanted]
    return replace(plan, adds=tuple(adds), removes=tuple(removes), present=tuple(present))


def runtime_plan(running: Config, new: Config) -> RuntimePlan:
    """The runtime changes that turn `running` into `new`, with the reason when only a reload can."""
    old_skeleton, new_skeleton = config_skeleton(running), config_skeleton(new)
    if old_skeleton != new_skeleton:
        found = membership(running, new, _without_runtime_fields, _first_difference)
        if isinstance(found, str):
            return RuntimePlan(None, found)
        pairs = [(o, old, n, fresh) for o, n, servers in found.common for old, fresh in servers]
        adds, removes = found.adds, found.removes
    else:
        pairs = []
        for (old_section, old_servers), (new_section, new_servers) in zip(
            running.servers_by_backend(), new.servers_by_backend(), strict=True
        ):
            if [s.name for s in old_servers] != [s.name for s in new_servers]:
                # The same skeleton cannot give other names; refuse rather than guess.
                return RuntimePlan(None, f"{new_section.kind} {new_section.name}: its servers differ")
            pairs += [(old_section, o, new_section, n) for o, n in zip(old_servers, new_servers, strict=True)]
        adds, removes = (), ()
    changes: list[ServerChange] = []
    for old_section, old, new_section, fresh in pairs:
        change = _server_change(old_section, old, new_section, fresh)
        if isinstance(change, str):
            return RuntimePlan(None, change)
        if change is not None:
            changes.append(change)
    return RuntimePlan(changes, "", adds, removes)


def _first_difference(old: list[tuple[str, ...]], new: list[tuple[str, ...]]) -> str:
    """Where two skeletons first differ: the line the new config lacks, the line it adds, or
    its line that differs, told apart by whether the lines after it line up again."""
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
    if (
        old_word == new_word
        and old.disabled == new.disabled
        and _weight(old) == _weight(new)
    ):
        return None
    try:
        change = ServerChange(
            backend=old.backend,
            server=old.name,
            from_address=old_endpoint[0],
            from_port=old_endpoint[1],
            to_address=new_endpoint[0],
            to_port=new_endpoint[1],
            from_weight=_weight(old),
            to_weight=_weight(new),
            was_enabled=not old.disabled,
            enabled=not new.disabled,
        )
    except ValueError as exc:
        return str(exc)
    if not change.address_changed and not change.weight_changed and change.was_enabled == change.enabled:
        return None  # the address was only spelled differently
    return change


def _is_subsequence(short: list[tuple[str, ...]], long: list[tuple[str, ...]]) -> bool:
    rest = iter(long)
    return all(any(line == other for other in rest) for line in short)


def transient_render(running: Config, new: Config) -> str | None:
    """Why `new` looks like a render caught in the middle of a rebuild, which its next render
    soon undoes (None when it does not): a reload would be needed, every line of `new` is in
    `running` in the same order (lines were only taken out), and a backend that has servers in
    `running` has none left in `new` but its backups. Ray Serve renders a redeployed app that way while it
    builds it again: its backend emptied and its frontend's metrics variable taken out, both
    back in the next render. A backend taken out with its routes (an app deleted) is not one."""
    primaries = {section.name: [s for s in servers if not s.backup] for section, servers in new.servers_by_backend()}
    emptied = [section.name for section, servers in running.servers_by_backend()
               if any(not s.backup for s in servers) and primaries.get(section.name) == []]
    if not emptied or not _is_subsequence(config_skeleton(new), config_skeleton(running)):
        return None
    plan = runtime_plan(running, new)
    if plan.changes is not None:
        return None
    return f"{', '.join(emptied)} lost every primary server and only lines were taken out ({plan.why_reload})"
