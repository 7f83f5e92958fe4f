"""A change to one live server, and the order of its commands.

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
import re
from dataclasses import dataclass

from ..names import ServerKey, validate_name

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
