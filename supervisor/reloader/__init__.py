"""Watch the rendered config, and turn each burst of changes into one safe reload.

watch -> debounce -> render -> skip if unchanged -> `haproxy -c` -> runtime apply or
(write effective, `reload` on the master CLI, confirm with `show proc`) -> new generation.

Read in this order: `decisions`, the pure functions that make every decision (when a cycle is
due, skip / runtime apply / reload, did a reload take, converged or why not); `watch`, what to
watch and what an event means; `records`, the generations book and the config on disk;
`recovery`, starting from what is there; `cycle`, the `Reloader`, which holds the parts, keeps
the tasks and takes each change to the master. Every module logs as `supervisor.reloader`
(`getLogger(__package__)`): the name operators grep for, however the package is cut.
"""

from .cycle import Reloader, ReloadHooks

__all__ = ["ReloadHooks", "Reloader"]
