"""Runtime changes to live servers, and the plan that says when a reload is not needed.

Every change this daemon makes to a live server's address, port, weight or enabled
state goes through this module. HAProxy runs each CLI command as its own locked
operation, even several on one `;` line, so between two commands a server routes
traffic in whatever state the first one left it. `set server B/S addr 127.0.0.1 port 1`
on a `ready` server makes it routable at the placeholder until the `state maint` that
follows lands: requests balanced to it in that window fail with 503 (termination state
SC), and without `option redispatch` every retry hits the same slot.

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

Make before break: the changes go out in two phases. First every change after which the
server is in service (enables, new addresses and weights of live servers), then the
disables. Within each backend the enables are complete (`state ready` accepted) before
any disable begins, so a backend never has fewer usable servers during a change than at
its start or at its end: a slot handing over to another in one write never leaves the
backend with no server (`backend 'be' has no server available!`, 503s). When a first-phase
command is refused in a backend, that backend's disables are not sent (the reload that
follows does them): nothing is broken that was not made.

Within a phase, commands are batched across servers, one step at a time: the first
command of every server's sequence on one master-CLI line (`@!<pid> cmd;@!<pid> cmd;...`),
every answer checked, then the second command of the servers whose first was accepted,
and so on. One `;` line runs all its commands whatever each answers, so the commands of
ONE server never share a line: a refusal can only stop what has not been sent yet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .api import DEFAULT_LINE_LIMIT, CLIError, MasterCLI, batch_lines, on_process, parse_show_map, validate_name
from .config import _SERVER_KEYWORDS_WITH_ARG, BACKEND_KINDS, Config, Section, Server
from .inject import is_guarded
from .membership import ServerAdd, ServerRemove, loaded_slot_table, membership, slot_map_commands
from .server_state import clear_server_state, save_server_state

log = logging.getLogger(__name__)

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
    def key(self) -> str:
        return f"{self.backend}/{self.server}"

    @property
    def address_changed(self) -> bool:
        return self.from_port != self.to_port or not _same_host(self.from_address, self.to_address)

    @property
    def weight_changed(self) -> bool:
        return self.from_weight != self.to_weight

    @property
    def to_endpoint(self) -> str:
        host = f"[{self.to_address}]" if ":" in self.to_address else self.to_address
        return host if self.to_port is None else f"{host}:{self.to_port}"


def ordered_commands(change: ServerChange) -> list[str]:
    """The CLI commands for one change, in the only order that never routes wrongly (module doc)."""
    target = f"{change.backend}/{change.server}"
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


# ---------------------------------------------------------------- planning


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
        if word in _SERVER_KEYWORDS_WITH_ARG and i + 1 < len(params):
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

    @property
    def membership_changes(self) -> bool:
        return bool(self.adds or self.removes)


def plan_runtime_apply(running: Config, new: Config) -> list[ServerChange] | None:
    """The in-place runtime changes that turn `running` into `new`, or None when they cannot
    (a reload, or servers added or removed: runtime_plan() has those).

    [] means nothing HAProxy sees differs (comments, spacing). Pass like with like:
    both effective configs (or both rendered), so injections compare equal.
    """
    plan = runtime_plan(running, new)
    return None if plan.membership_changes else plan.changes


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
    """Where two skeletons first differ, as the line of the new config (or the one it lacks)."""
    index = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    skeleton, what = (new, "") if index < len(new) else (old, " is gone")
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


# ---------------------------------------------------------------- applying

# What `set server ... addr` answers when it took. 2.6 and 2.8: `no need to change the addr, port
# changed from 'a' to 'b' by 'stats socket command'` (either part may say changed or no need);
# 3.0 on: `IP changed from 'a' to 'b', port changed from ... by ...`, either part alone, or
# `nothing changed`.
_ADDR_ACCEPTED = re.compile(
    r"^(?:nothing changed\.?"
    r"|(?:(?:IP changed from '[^']*' to '[^']*'|no need to change the addr)"
    r"(?:, (?:port changed from '[^']*' to '[^']*'|no need to change the port))?"
    r"|port changed from '[^']*' to '[^']*')"
    r" by '[^']*'\.?)$"
)


def split_answers(text: str, count: int) -> list[str] | None:
    """One answer per command of a `;` line, or None when they cannot be told apart.

    Each command's answer is its text followed by an empty line; a command that prints
    nothing answers the empty line alone. A master-level error (`Can't find the target
    PID`) ends the line early, so the count no longer matches.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    answers: list[str] = []
    current: list[str] = []
    for line in lines:
        if line == "":
            answers.append("\n".join(current))
            current = []
        else:
            current.append(line)
    if current:
        answers.append("\n".join(current))
    return answers if len(answers) == count else None


def refusal(command: str, answer: str | None) -> str | None:
    """None when HAProxy accepted `command`, else why not (its own words when it gave any).

    `state` and `weight` print nothing when they succeed; `addr` prints what it changed.
    Anything else, including an answer this code does not know, counts as refused: the
    safe reading, since the sequence then stops with the server out of rotation.
    """
    if answer is None:
        return "no answer"
    text = answer.strip()
    if " addr " in command:
        return None if _ADDR_ACCEPTED.match(text) else (text or "empty answer to addr")
    return None if text == "" else text


@dataclass(frozen=True, slots=True)
class Refusal:
    change: ServerChange
    command: str
    answer: str
    accepted: tuple[str, ...]  # the commands of this server's sequence that HAProxy accepted

    @property
    def left_in_maint(self) -> bool:
        return any(c.endswith(" state maint") for c in self.accepted)


@dataclass
class ApplyResult:
    applied: list[ServerChange] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    # Disables not sent because a first-phase command of their backend was refused.
    skipped: list[ServerChange] = field(default_factory=list)
    commands_sent: int = 0
    lines_sent: int = 0

    @property
    def ok(self) -> bool:
        return not self.refused and not self.skipped


async def _send_line(cli: MasterCLI, line: str, count: int) -> list[str | None]:
    try:
        text = await cli.execute(line)
    except CLIError as exc:
        return [f"no answer: {exc}"] * count
    answers = split_answers(text, count)
    if answers is None:
        # Cannot tell which command said what: every command of the line counts as refused.
        unexpected = text.strip() or "empty answer"
        return [f"unexpected answer to {count} commands: {unexpected}"] * count
    return list(answers)


async def _send_step(
    cli: MasterCLI, worker_pid: int, commands: Sequence[str], line_limit: int
) -> tuple[list[str | None], int]:
    """Send one step's commands (one per server) as few `;` lines as fit; answers in order."""
    lines = batch_lines([on_process(worker_pid, c) for c in commands], line_limit)
    tasks: list[asyncio.Task[list[str | None]]] = []
    async with asyncio.TaskGroup() as group:
        for line in lines:
            # Names and addresses are validated, so `;` only ever separates commands.
            tasks.append(group.create_task(_send_line(cli, line, line.count(";") + 1)))
    answers: list[str | None] = []
    for task in tasks:
        answers.extend(task.result())
    return answers, len(lines)


def takes_out(change: ServerChange) -> bool:
    """Does the change take a server out of service (a disable)?"""
    return change.was_enabled and not change.enabled


def make_before_break(changes: Iterable[ServerChange]) -> list[list[ServerChange]]:
    """The phases of a change (module doc): what leaves servers in service, then the disables."""
    changes = list(changes)
    making = [c for c in changes if not takes_out(c)]
    breaking = [c for c in changes if takes_out(c)]
    return [phase for phase in (making, breaking) if phase]


async def apply_changes(
    cli: MasterCLI,
    worker_pid: int,
    changes: Iterable[ServerChange],
    *,
    order: Callable[[ServerChange], list[str]] = ordered_commands,
    line_limit: int = DEFAULT_LINE_LIMIT,
    phased: bool = True,
) -> ApplyResult:
    """Apply changes to one worker, make before break, step by step across servers, checking
    every answer.

    `order` and `phased=False` (every change in one phase) exist so a test can drive the
    wrong order and show the window it opens.
    """
    worker_pid = int(worker_pid)
    result = ApplyResult()
    changes = list(changes)
    unmade: set[str] = set()  # backends where a first-phase command was refused
    for phase in make_before_break(changes) if phased else [changes]:
        skipped = [c for c in phase if c.backend in unmade]
        if skipped:
            result.skipped.extend(skipped)
            log.warning(
                "worker %d: %d disables not sent in backends %s, where an enable was refused",
                worker_pid, len(skipped), ", ".join(sorted({c.backend for c in skipped})),
            )
        refused = await _apply_steps(cli, worker_pid, [c for c in phase if c.backend not in unmade], order,
                                     line_limit, result)
        unmade.update(r.change.backend for r in refused)
    return result


async def _apply_steps(
    cli: MasterCLI,
    worker_pid: int,
    changes: list[ServerChange],
    order: Callable[[ServerChange], list[str]],
    line_limit: int,
    result: ApplyResult,
) -> list[Refusal]:
    """One phase: every server's sequence, step by step across servers; adds to `result` and
    returns this phase's refusals."""
    plans = [(change, order(change)) for change in changes]
    accepted: list[list[str]] = [[] for _ in plans]
    stopped: dict[int, Refusal] = {}
    step = 0
    while True:
        batch = [
            (i, sequence[step])
            for i, (_, sequence) in enumerate(plans)
            if step < len(sequence) and i not in stopped
        ]
        if not batch:
            break
        answers, lines = await _send_step(cli, worker_pid, [command for _, command in batch], line_limit)
        result.commands_sent += len(batch)
        result.lines_sent += lines
        for (i, command), answer in zip(batch, answers, strict=True):
            reason = refusal(command, answer)
            if reason is None:
                accepted[i].append(command)
                continue
            refused = Refusal(plans[i][0], command, reason, tuple(accepted[i]))
            stopped[i] = refused
            log.warning(
                "worker %d refused %r: %s; %s",
                worker_pid,
                command,
                reason,
                "server left in maint" if refused.left_in_maint else "server left as it was",
            )
        step += 1
    for i, (change, _) in enumerate(plans):
        if i in stopped:
            result.refused.append(stopped[i])
        else:
            result.applied.append(change)
    return list(stopped.values())


# ---------------------------------------------------------------- servers added and removed

REMOVE_POLL_S = 0.1
PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT = "127.0.0.1", 1
# After `shutdown sessions server`, how long `del server` is still tried: the sessions close
# asynchronously, within a few milliseconds of the command.
AFTER_SHUTDOWN_S = 2.0


def _added(answer: str | None) -> bool:
    return answer is not None and answer.strip().startswith("New server registered")


def _deleted(answer: str | None) -> bool:
    return answer is not None and answer.strip().startswith("Server deleted")


def _needs_experimental_mode(answer: str | None) -> bool:
    return answer is not None and "experimental" in answer.lower()


@dataclass
class MembershipResult:
    """What apply_membership() did. Not ok: `why` (one line) is the reason for the reload
    that follows. `made`: added servers are in service in the worker (the removes failed),
    so it runs the new config's servers, plus removed ones left in maint."""

    ok: bool = True
    why: str = ""
    made: bool = False
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    commands_sent: int = 0


class _Sender:
    """One worker's commands, as few `;` lines as fit, every answer returned in order."""

    def __init__(self, cli: MasterCLI, worker_pid: int, line_limit: int, result: MembershipResult) -> None:
        self.cli, self.pid, self.line_limit, self.result = cli, worker_pid, line_limit, result
        self.prefix: list[str] = []  # `experimental-mode on`, once a worker asked for it

    async def send(self, commands: Sequence[str]) -> list[str | None]:
        if not commands:
            return []
        self.result.commands_sent += len(commands)
        if not self.prefix:
            answers, _ = await _send_step(self.cli, self.pid, commands, self.line_limit)
            return answers
        answers: list[str | None] = []
        for command in commands:  # the master session's mode rides with the command on one line
            line = ";".join([*self.prefix, on_process(self.pid, command)])
            answers.append((await _send_line(self.cli, line, len(self.prefix) + 1))[-1])
        return answers


async def apply_membership(
    cli: MasterCLI,
    worker_pid: int,
    plan: RuntimePlan,
    new: Config,
    *,
    remove_wait_s: float,
    line_limit: int = DEFAULT_LINE_LIMIT,
) -> MembershipResult:
    """Add and remove servers in one worker, make before break (module doc of membership.py):
    add in maint, enable checks, ready; the in-place changes; the worker's slot table; only
    then the removed servers to maint, their sessions waited for (`remove_wait_s`, then
    `shutdown sessions server`), and `del server`."""
    pid = int(worker_pid)
    result = MembershipResult()
    sender = _Sender(cli, pid, line_limit, result)
    backends = {a.backend for a in plan.adds} | {r.backend for r in plan.removes}
    table = await _slot_table_commands(cli, pid, new, backends)
    if isinstance(table, str):
        return _failed(result, table)
    why = await _add(sender, plan.adds, result)
    if why:
        await _take_back(sender, result.added, remove_wait_s)
        return _failed(result, why)
    if plan.changes:
        applied = await apply_changes(cli, pid, plan.changes, line_limit=line_limit)
        result.commands_sent += applied.commands_sent
        if not applied.ok:
            await _take_back(sender, result.added, remove_wait_s)
            return _failed(result, f"{len(applied.refused)} in-place server changes refused")
    result.made = True
    table_answers = await sender.send(table)
    for command, answer in zip(table, table_answers, strict=True):
        if answer is None or answer.strip():
            return _failed(result, f"slot table: {command!r} refused: {(answer or 'no answer').strip()}")
    why = await _remove(sender, [r.key for r in plan.removes], remove_wait_s, result)
    if why:
        return _failed(result, why)
    return result


def _failed(result: MembershipResult, why: str) -> MembershipResult:
    result.ok, result.why = False, why
    return result


async def _slot_table_commands(cli: MasterCLI, pid: int, new: Config, backends: set[str]) -> list[str] | str:
    """The map commands that keep the worker's slot table what `new` says (the guard reads it
    once the worker is old), or why they cannot be known."""
    if not any(is_guarded(s) for s in new.backends() if s.name in backends):
        return []
    try:
        path = loaded_slot_table(await cli.on(pid, "show map"))
        if path is None:
            return f"worker {pid} lists no slot table in `show map`"
        held = dict(parse_show_map(await cli.on(pid, f"show map {path}")))
    except (CLIError, ValueError) as exc:
        return f"cannot read worker {pid}'s slot table: {exc}"
    return slot_map_commands(path, held, new, backends)


async def _add(sender: _Sender, adds: Sequence[ServerAdd], result: MembershipResult) -> str:
    """Add every server in maint, then step by step its checks and `state ready`; the first
    refusal, or ''."""
    answers = await sender.send([a.add_command for a in adds])
    if any(_needs_experimental_mode(a) for a in answers):
        sender.prefix = ["experimental-mode on"]
        log.info("worker %d: `add server` needs experimental-mode on this HAProxy: enabled", sender.pid)
        retry = [i for i, a in enumerate(answers) if _needs_experimental_mode(a)]
        for i, answer in zip(retry, await sender.send([adds[i].add_command for i in retry]), strict=True):
            answers[i] = answer
    why = ""
    for add, answer in zip(adds, answers, strict=True):
        if _added(answer):
            result.added.append(add.key)
        elif not why:
            why = f"`{add.add_command}` refused: {(answer or 'no answer').strip() or 'empty answer'}"
    if why:
        return why
    sequences = [add.ready_commands for add in adds]
    step = 0
    while True:
        batch = [seq[step] for seq in sequences if step < len(seq)]
        if not batch:
            return ""
        for command, answer in zip(batch, await sender.send(batch), strict=True):
            reason = refusal(command, answer)
            if reason is not None:
                return f"`{command}` refused: {reason}"
        step += 1


async def _take_back(sender: _Sender, keys: list[str], wait_s: float) -> None:
    """Undo adds after a refusal: the servers out of service and deleted (best effort)."""
    if keys:
        leftover = await _remove(sender, list(keys), wait_s, MembershipResult())
        if leftover:
            log.warning("worker %d: servers added before a refusal not all deleted: %s", sender.pid, leftover)


async def _remove(sender: _Sender, keys: list[str], wait_s: float, result: MembershipResult) -> str:
    """Servers to maint, then `del server` until each is accepted: while sessions are attached
    HAProxy refuses it; after `wait_s` their sessions are shut down and it is tried a little
    longer. What is still refused then, or ''."""
    if not keys:
        return ""
    answers = await sender.send([f"set server {key} state maint" for key in keys])
    refused = [(k, a) for k, a in zip(keys, answers, strict=True) if refusal("state", a) is not None]
    if refused:
        key, answer = refused[0]
        return f"`set server {key} state maint` refused: {(answer or 'no answer').strip()}"
    left = list(keys)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    shut = purged = False
    last = ""
    while True:
        answers = await sender.send([f"del server {key}" for key in left])
        for key, answer in zip(list(left), answers, strict=True):
            if _deleted(answer):
                left.remove(key)
                result.removed.append(key)
            else:
                last = f"`del server {key}`: {(answer or 'no answer').strip()}"
        if not left:
            return ""
        if not purged:
            # HAProxy counts the server's idle connections as attached and purges them only
            # slowly; a new address (it is in maint: nothing routes to it) closes them at once.
            await sender.send([f"set server {key} addr {PLACEHOLDER_ADDRESS} port {PLACEHOLDER_PORT}" for key in left])
            purged = True
            continue
        if loop.time() >= deadline:
            if shut:
                return f"{len(left)} servers not deleted after {wait_s:g}s and their sessions shut down; last {last}"
            log.info("worker %d: sessions still on %d removed servers after %gs: shutting them down",
                     sender.pid, len(left), wait_s)
            await sender.send([f"shutdown sessions server {key}" for key in left])
            shut = True
            deadline = loop.time() + AFTER_SHUTDOWN_S
        await asyncio.sleep(REMOVE_POLL_S)


# ---------------------------------------------------------------- the reloader's hook


class _Generation(Protocol):
    model: Config
    worker_pid: int | None


class _Effective(Protocol):
    text: str


class RuntimeApplier:
    """`runtime_apply(current, new_model, effective) -> bool` for the reloader.

    True: the change is live in the current worker and no reload is needed (the reloader
    then writes the effective config and updates the generation's model in place).
    False: a reload must do it; either the plan needs one, or a command was refused.
    Servers whose sequence was refused are remembered in `forget`, so that the next
    server-state save leaves them out and the reload starts them from the config rather
    than keeping them in the maint this module left them in.
    """

    def __init__(self, cli: MasterCLI, line_limit: int = DEFAULT_LINE_LIMIT, remove_wait_s: float = 10.0) -> None:
        self.cli = cli
        self.line_limit = line_limit
        self.remove_wait_s = remove_wait_s
        self.forget: set[str] = set()
        self.last_result: ApplyResult | None = None

    async def __call__(self, current: _Generation, new_model: Config, effective: _Effective | None = None) -> bool:
        # Compare effective with effective: the generation's model is the effective config.
        new = effective.effective_model if effective is not None else new_model
        if current.worker_pid is None:
            return False
        plan = runtime_plan(current.model, new)
        changes = plan.changes
        if changes is None:
            log.info("runtime apply not possible, reloading: %s", plan.why_reload)
            return False
        if plan.membership_changes:
            return await self._apply_membership(current, plan, new)
        if not changes:
            return True
        result = await apply_changes(self.cli, current.worker_pid, changes, line_limit=self.line_limit)
        self.last_result = result
        for change in result.applied:
            self.forget.discard(change.key)
        for refused in result.refused:
            self.forget.add(refused.change.key)
        log.info(
            "runtime apply to worker %d: %d servers changed, %d refused, %d not sent, %d commands on %d lines",
            current.worker_pid, len(result.applied), len(result.refused), len(result.skipped),
            result.commands_sent, result.lines_sent,
        )
        return result.ok

    async def _apply_membership(self, current: _Generation, plan: RuntimePlan, new: Config) -> bool:
        assert current.worker_pid is not None
        result = await apply_membership(
            self.cli, current.worker_pid, plan, new, remove_wait_s=self.remove_wait_s, line_limit=self.line_limit
        )
        log.info(
            "runtime apply to worker %d: %d servers added, %d removed, %d changed in place, %d commands",
            current.worker_pid, len(result.added), len(result.removed), len(plan.changes or ()),
            result.commands_sent,
        )
        if result.ok:
            return True
        log.info("runtime apply not possible, reloading: %s", result.why)
        if result.made:
            # The new servers are in service there: the worker runs the new config's servers
            # (and removed ones left in maint), which is what its steering must go by once old.
            current.model = new
        return False

    async def save_server_state(self, current: _Generation, new_model: Config, path: Path) -> bool:
        """Before a reload to `new_model`: save the current worker's state, minus what must not carry over."""
        if current.worker_pid is None:
            clear_server_state(path)
            return False
        saved = await save_server_state(
            self.cli, current.worker_pid, path, running=current.model, new=new_model, forget=self.forget
        )
        if saved:
            self.forget.clear()
        return saved
