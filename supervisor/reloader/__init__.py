"""Watch the rendered config, and turn each burst of changes into one safe reload: watch ->
debounce -> skip if unchanged -> `haproxy -c` -> runtime apply, or write, `reload`, confirm
with `show proc` -> new generation. Read `decisions` (pure), `watch`, `records`, `recovery`,
then `cycle`, the `Reloader`. Every module logs as `supervisor.reloader`, what operators grep for.
"""

from .cycle import Reloader, ReloadHooks

__all__ = ["ReloadHooks", "Reloader"]
