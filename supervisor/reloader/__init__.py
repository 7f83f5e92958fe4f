"""Watch the rendered config, and turn each burst of changes into one safe reload.

watch -> debounce -> render -> skip if unchanged -> `haproxy -c` -> runtime apply or
(write effective, `reload` on the master CLI, confirm with `show proc`) -> new generation.

Pure functions make every decision, each unit-tested with a table; a few parts each own
their fields; `Reloader` holds the parts and keeps the tasks, the way gunicorn's Arbiter
does. No class is spread over modules. Read in this order:

- `decisions`: when the next cycle is due (debounce, min interval, retry backoff); what to do
  with a change (skip, runtime apply, reload); does the node run the rendered config, why
  not, is that passing, when to retry; how trouble is worded. Pure.
- `confirm`: did a reload take, from `show proc` (pure), and `Confirmation`, the owner of a
  reload HAProxy has not confirmed yet.
- `watch`: what to watch along each path, which filesystem events count as a change, inotify,
  the safety-net look and the digest of watched files.
- `hooks`: what is plugged in: the steering's hooks, the runtime apply, the state save.
- `records`: `GenerationBook`, the owner of the generations (published into State) and of the
  files that record them (`GenerationStore`, the adoption plan); `OldWorkerCap`,
  old_workers.max; `ConfigOnDisk`, the owner of the effective config on disk and of what runs.
- `parts`: the parts together, and the steps several of them take at once.
- `cycle`: one change under master.lock: settle, decide, check, runtime apply or reload.
- `recovery`: first start, master restart, adoption after a daemon restart, runtime_dir lost.
- `core`: the `Reloader`: its tasks (watch, schedule, housekeeping), requests and handlers.

Every module logs as `supervisor.reloader` (`getLogger(__package__)`): the log lines keep the
name operators grep for, however the package is cut.
"""

from .core import Reloader
from .hooks import ReloadHooks

__all__ = ["ReloadHooks", "Reloader"]
