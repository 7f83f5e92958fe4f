"""Controller-socket mode: an ingress controller in the same pod talks to the daemon's sockets
as it would to HAProxy's (docs/controller.md). relay.py: the runtime socket, commands sent in a
safe order; facade.py: the master socket, `reload` by the daemon's cycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..files import mode_bits, owner_ids
from ..settings import Settings
from ..state import ReloadRecord
from .connections import HAPROXY_STATS_MAXCONN
from .facade import MasterFacade
from .relay import RuntimeRelay

if TYPE_CHECKING:
    from ..steering.workers import OldWorkers as Marks  # the operator marks of the old workers

log = logging.getLogger(__name__)


def steer_on_service(marks: Callable[[], Marks | None]) -> Callable[[str, bool], None]:
    """A server the controller takes out of service is known-dead to the old workers at once
    (they refuse server commands: steering is the one road to them); put back, it is unmarked."""

    def on_service(key: str, in_service: bool) -> None:
        component = marks()
        try:
            if component is None or not component.has_server(key):
                return
            if in_service:
                component.unmark_dead(key)
            else:
                component.mark_dead(key)
                log.info("controller took %s out of service: known-dead to the old workers", key)
        except ValueError as exc:  # a name the master CLI could not carry
            log.warning("controller runtime socket: %s", exc)

    return on_service


class ControllerSockets:
    """The sockets the settings ask for; `start()` binds them, `run()` serves until cancelled."""

    def __init__(
        self, settings: Settings, reload_now: Callable[[], Awaitable[ReloadRecord | None]],
        marks: Callable[[], Marks | None], capacity: Callable[[], int] = lambda: HAPROXY_STATS_MAXCONN,
    ) -> None:
        c = settings.controller
        mode, owner = mode_bits(c.socket_mode), owner_ids(c.socket_owner) if c.socket_owner else None
        self.relay = (
            RuntimeRelay(c.runtime_socket, settings.haproxy.stats_socket, steer_on_service(marks), capacity,
                         c.queue_timeout_s, c.idle_timeout_s, mode, owner)
            if c.runtime_socket is not None else None
        )
        self.facade = (
            MasterFacade(c.master_socket, settings.haproxy.master_socket_path, reload_now, c.idle_timeout_s,
                         mode, owner)
            if c.master_socket is not None else None
        )

    @property
    def enabled(self) -> bool:
        return self.relay is not None or self.facade is not None

    async def start(self) -> None:
        for server in (self.relay, self.facade):
            if server is not None:
                await server.start()

    async def run(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def close(self) -> None:
        for server in (self.relay, self.facade):
            if server is not None:
                await server.close()

