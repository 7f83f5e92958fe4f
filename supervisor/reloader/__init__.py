"""Watch the rendered config, and turn each burst of changes into one safe reload.

watch -> debounce -> render -> skip if unchanged -> `haproxy -c` -> runtime apply or
(write effective, `reload` on the master CLI, confirm with `show proc`) -> new generation.

The decisions (when to reload, whether a reload took, which old workers exceed the
limit, which paths are relevant) are pure and unit-tested; the I/O is a thin shell around
them, tested end to end with the real binary. One `Reloader` object owns it all; its
methods are grouped by idea, one module each, read in this order:

- `schedule`: when the next cycle is due (debounce, min interval, retry backoff); pure.
- `watch`: which filesystem events count as a change, and the digest of watched files.
- `problems`: disk errors as the shell words them; HAProxy's message on one line.
- `base`: the hooks, the reloader's collaborators and state, shared by every part.
- `bookkeeping`: the generations, and the files that record them and what runs.
- `convergence`: does the node run the rendered config; if not, when to try again.
- `confirm`: did a reload take, decided from `show proc`, now or later.
- `cycle`: one change: check, runtime apply or reload, record.
- `recovery`: first start, master restart, adoption after a daemon restart, runtime_dir lost.
- `core`: the `Reloader` itself: its tasks (watch, schedule, housekeeping) and requests.

Every module logs as `supervisor.reloader` (`getLogger(__package__)`): the log lines keep the
name operators grep for, however the package is cut.
"""

from .base import NoHooks, ReloadHooks
from .core import Reloader

__all__ = ["NoHooks", "ReloadHooks", "Reloader"]
