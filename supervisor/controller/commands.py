"""The lines an ingress controller sends to HAProxy's runtime socket, read as commands.

One line carries several commands separated by `;` (a `\\;` is part of a word), and may
end with `<<`: the payload that follows belongs to the line's last command. Everything here
is pure: the relay (relay.py) asks which order is safe and which servers a line takes out of
service, and sends the controller's own bytes.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import Enum

from ..haproxy.answers import ServerKey

PAYLOAD_MARK = b"<<"


class Effect(Enum):
    """What a command does to one server's place in the balancing."""

    ADDRESS = "address"  # `set server B/S addr ...`: where it points
    OUT_OF_SERVICE = "out of service"  # maint, `disable server`, health or agent down
    IN_SERVICE = "in service"  # ready, `enable server`, health or agent up
    OTHER = "other"  # weight, maxconn, ... : names the server, changes neither


@dataclass(frozen=True)
class Command:
    text: bytes  # as the controller wrote it, without the `;`
    server: str | None = None  # "backend/server" of a server command
    effect: Effect | None = None


def split_line(line: bytes) -> list[bytes]:
    """The commands of one line (without its newline), split on `;` not escaped by a backslash."""
    commands: list[bytes] = []
    start = 0
    escaped = False
    for i, byte in enumerate(line):
        if escaped:
            escaped = False
        elif byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x3B:  # ;
            commands.append(line[start:i])
            start = i + 1
    commands.append(line[start:])
    return commands


def parse_command(text: bytes) -> Command:
    """A command's target server and effect, when it is a server command."""
    words = text.split()
    if len(words) >= 3 and words[0] == b"disable" and words[1] == b"server":
        return Command(text, _key(words[2]), Effect.OUT_OF_SERVICE)
    if len(words) >= 3 and words[0] == b"enable" and words[1] == b"server":
        return Command(text, _key(words[2]), Effect.IN_SERVICE)
    if len(words) >= 4 and words[0] == b"set" and words[1] == b"server":
        key = _key(words[2])
        what, value = words[3], words[4] if len(words) > 4 else b""
        if what in (b"addr", b"fqdn"):
            return Command(text, key, Effect.ADDRESS)
        if what == b"state":
            if value == b"maint":
                return Command(text, key, Effect.OUT_OF_SERVICE)
            if value == b"ready":
                return Command(text, key, Effect.IN_SERVICE)
        if what in (b"health", b"agent"):
            if value == b"down":
                return Command(text, key, Effect.OUT_OF_SERVICE)
            if value == b"up":
                return Command(text, key, Effect.IN_SERVICE)
        return Command(text, key, Effect.OTHER)
    return Command(text)


def _key(word: bytes) -> str | None:
    backend, sep, server = word.decode(errors="replace").partition("/")
    return ServerKey.of(backend, server) if sep and backend and server else None


def parse_line(line: bytes) -> list[Command]:
    return [parse_command(text) for text in split_line(line)]


def safe_order(commands: list[Command]) -> list[int]:
    """The order to send the commands in, as indexes into `commands`.

    A server whose address changes and then goes out of service on the same line is taken
    out first: sent in the controller's order, a ready server points at the placeholder
    address for a moment and the requests balanced to it fail (503, `SC`). The command that
    takes it out moves to just before the run of address changes that precedes it (among the
    commands naming that server); every other command keeps its place and order.
    """
    order = list(range(len(commands)))
    for j, command in enumerate(commands):
        if command.effect is not Effect.OUT_OF_SERVICE or command.server is None:
            continue
        earliest = None
        for position in range(order.index(j) - 1, -1, -1):
            earlier = commands[order[position]]
            if earlier.server != command.server:
                continue
            if earlier.effect is not Effect.ADDRESS:
                break
            earliest = position
        if earliest is not None:
            order.remove(j)
            order.insert(earliest, j)
    return order


@dataclass(frozen=True)
class Address:
    """Where an address command points a server: what `show servers state` shows once applied."""

    server: str
    address: str
    port: int | None  # None: the command keeps the port


def requested_address(command: Command) -> Address | None:
    """The IP (and port) of `set server B/S addr IP [port P]`; None for a name (fqdn) or no IP."""
    words = command.text.split()
    if command.server is None or command.effect is not Effect.ADDRESS or words[3:4] != [b"addr"] or len(words) < 5:
        return None
    address = words[4].decode(errors="replace")
    if not is_ip_literal(address):
        return None
    port = None
    if len(words) >= 7 and words[5] == b"port":
        if not words[6].isdigit():
            return None
        port = int(words[6])
    return Address(command.server, address, port)


def is_ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def address_waits(commands: list[Command], order: list[int]) -> dict[int, Address]:
    """The address commands, by index, whose change must have taken effect before the next
    command is sent: those followed (among the commands naming their server, in the order
    sent) by one that puts the server in service. From 3.0 HAProxy applies an address change
    later, from a task of its own, while `state ready` takes effect at once: sent back to
    back, the server is ready for a moment at the address it had (the placeholder of its
    last disable) and requests balanced to it fail with 503 `SC`."""
    waits: dict[int, Address] = {}
    for position, index in enumerate(order):
        target = requested_address(commands[index])
        if target is None:
            continue
        for later in order[position + 1 :]:
            if commands[later].server != target.server:
                continue
            if commands[later].effect is Effect.IN_SERVICE:
                waits[index] = target
            break
    return waits


def service_changes(commands: list[Command]) -> dict[str, bool]:
    """Per server the line takes out of service (False) or puts back (True): its last word."""
    changes: dict[str, bool] = {}
    for command in commands:
        if command.server is None:
            continue
        if command.effect is Effect.OUT_OF_SERVICE:
            changes[command.server] = False
        elif command.effect is Effect.IN_SERVICE:
            changes[command.server] = True
    return changes


def session_prefix(commands: list[Command]) -> int:
    """How many leading commands set up the session (`set severity-output ...`): each command
    sent on a connection of its own gets them first, so its answer reads as on the line."""
    count = 0
    for command in commands:
        words = command.text.split()
        if words[:2] != [b"set", b"severity-output"]:
            break
        count += 1
    return count


def has_payload(line: bytes) -> bool:
    """Whether the payload that follows a line belongs to it (HAProxy's `<<` at its end)."""
    return line.rstrip(b"\r").endswith(PAYLOAD_MARK)
