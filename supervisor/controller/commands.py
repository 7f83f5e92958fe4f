"""The lines an ingress controller sends to HAProxy's runtime socket, read as commands.

One line carries several commands separated by `;` (a `\\;` is part of a word), and may
end with `<<`: the payload that follows belongs to the line's last command. Everything here
is pure: the relay (relay.py) asks which order is safe and which servers a line takes out of
service, and sends the controller's own bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

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
    return f"{backend}/{server}" if sep and backend and server else None


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
