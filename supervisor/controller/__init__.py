"""Controller-socket mode: an ingress controller in the same pod talks to the daemon's sockets
as it would to HAProxy's (docs/controller.md). relay.py: the runtime socket, commands sent in a
safe order; facade.py: the master socket, `reload` by the daemon's cycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..files import mode_bits, owner_ids
from ..settings import Settings
from .facade import MasterFacade, ReloadNow
from .relay import RuntimeRelay

if TYPE_CHECKING:
    from ..steering.workers import OldWorkers as Marks  # the operator marks of the old workers

log = logging.getLogger(__name__)


class ControllerSockets:
    """The sockets the settings ask for; `start()` binds them, `run()` serves until cancelled."""

    def __init__(
        self, settings: Settings, reload_now: ReloadNow, marks: Callable[[], Marks | None], capacity: Callable[[], int],
    ) -> None:
        self.marks = marks
        c = settings.controller
        mode, owner = mode_bits(c.socket_mode), owner_ids(c.socket_owner) if c.socket_owner else None
        self.servers: list[RuntimeRelay | MasterFacade] = []
        if c.runtime_socket is not None:
            self.servers.append(RuntimeRelay(c.runtime_socket, settings.haproxy.stats_socket, self._on_service,
                                             capacity, c.queue_timeout_s, c.idle_timeout_s, mode, owner))
        if c.master_socket is not None:
            self.servers.append(MasterFacade(c.master_socket, settings.haproxy.master_socket_path, reload_now,
                                             c.idle_timeout_s, mode, owner))

    @property
    def enabled(self) -> bool:
        return bool(self.servers)

    def _on_service(self, key: str, in_service: bool) -> None:
        """A server the controller takes out of service is known-dead to the old workers at once
        (they refuse server commands: steering is the one road to them); put back, it is unmarked."""
        component = self.marks()
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

    async def start(self) -> None:
        for server in self.servers:
            await server.start()

    async def run(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def close(self) -> None:
        for server in self.servers:
            await server.close()
