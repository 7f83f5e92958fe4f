"""When a pending removal ends after a reload (runtime/hook.py: why_ended); pure."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from supervisor.haproxy.runtime.hook import why_ended
from supervisor.state import PendingRemoval

OLD, CURRENT = 100, 200
ENDPOINT = ("127.0.0.1", 9001)


def removal(worker_pid: int, endpoint: tuple[str, int] | None = ENDPOINT) -> PendingRemoval:
    return PendingRemoval("app1/app1_r1", worker_pid, datetime(2026, 1, 1, tzinfo=UTC), 0.0, endpoint=endpoint)


@pytest.mark.parametrize(
    ("pending", "current", "alive", "held", "ends"),
    [
        # In the current worker: only its `del server` ends it.
        (removal(CURRENT), CURRENT, True, 0, None),
        (removal(CURRENT), CURRENT, True, None, None),
        # No current worker known (between masters): nothing is decided.
        (removal(OLD), None, True, 0, None),
        # In an old worker that still holds connections to it, or could not be counted: kept.
        (removal(OLD), CURRENT, True, 2, None),
        (removal(OLD), CURRENT, True, None, None),
        # In an old worker that holds none any more, or exited: ended.
        (removal(OLD), CURRENT, True, 0, "old worker 100 holds no connection to 127.0.0.1:9001"),
        (removal(OLD), CURRENT, False, 2, "worker 100 exited"),
        # Its address unknown (left by an earlier daemon): nothing to count, it ends at the reload.
        (removal(OLD, None), CURRENT, True, None,
         "worker 100 is no longer the current worker and its address is unknown"),
    ],
)
def test_a_removal_pending_in_an_old_worker_ends_when_it_holds_nothing_or_exits(pending, current, alive, held, ends):
    assert why_ended(pending, current, alive, held) == ends
