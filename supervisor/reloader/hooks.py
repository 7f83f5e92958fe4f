"""What is plugged into the reloader: the displaced-worker hooks around each change, the
runtime apply, and the server-state save before a reload."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from ..effective import Effective
from ..haproxy.config import Config
from ..haproxy.runtime import RuntimeOutcome
from ..state import Generation

log = logging.getLogger(__package__)


class ReloadHooks(Protocol):
    """What the displaced-worker component needs around each change. prepare() returns its
    plan for the reload, which the reloader hands to before_reload() as it is, and what
    before_reload() returns to after_reload()."""

    async def prepare(self, effective: Effective) -> Any: ...

    async def before_reload(self, plan: Any) -> Any: ...

    async def after_reload(self, plan: Any, ok: bool) -> object: ...

    async def refresh(self) -> None: ...


# (current generation, new effective model, the effective config) -> what the worker now runs.
RuntimeApply = Callable[[Generation, Config, Effective], Awaitable[RuntimeOutcome]]
# (current generation, next effective model, state file) -> saved. Runs just before a reload so
# the new worker starts with the current worker's server states (maint, DOWN, weights).
SaveServerState = Callable[[Generation, Config, Path], Awaitable[bool]]


async def call_hook(hooks: ReloadHooks, name: str, *args: object) -> Any:
    """The hook's answer; None if it raised."""
    # A component's failure must not stop a reload that protects the fleet from stale configs.
    try:
        return await getattr(hooks, name)(*args)
    except Exception:
        log.exception("hook %s raised", name)
        return None
