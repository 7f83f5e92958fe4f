"""Turn each burst of changes to the rendered config into one safe reload. Read `decisions`
(pure), `watch`, `records`, `recovery`, then `cycle`. Every module logs as `supervisor.reloader`."""

from .cycle import Reloader

__all__ = ["Reloader"]
