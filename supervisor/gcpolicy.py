"""When Python's cyclic garbage collector may run: not in the middle of a reload.

The daemon keeps one parsed config per live generation: with 50 old workers of a
10,000-server config that is millions of objects, all long-lived. A full collection walks
every one of them (hundreds of milliseconds), and it starts whenever enough new objects
have survived, which is during a reload, the moment the next config is parsed. Freezing
what is alive after each reload moves it out of the collector's rounds for good.

Young collections still come every few hundred new containers, and building the next
config, working out its steering and pushing it make hundreds of thousands: ~15 ms of
collections per reload at 10,000 servers, on the way to steering the old workers. So the
collector is paused for the reload cycle, and settle_after_reload() collects after it.

Nothing leaks by it: the config models, their digests and the per-worker state are
acyclic (tests/test_gcpolicy.py), so reference counting frees a generation's objects
the moment the daemon forgets it, frozen or not.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def settle_after_reload() -> None:
    """Collect the young garbage (cheap), then freeze everything still alive."""
    gc.collect(1)
    gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside (a reload cycle: bounded by reload.timeout_s); the
    collector is left as it was found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
