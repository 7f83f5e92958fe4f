"""Removals a killed daemon left pending, found by the next one (runtime/hook.py:
left_pending), over what the worker holds and its generation's config; pure."""

from __future__ import annotations

import pytest

from supervisor.haproxy.answers import ServerState
from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.hook import left_pending

CONFIG = Config.parse("""\
defaults
    mode http
backend app1
    server app1_r2 127.0.0.1:9002 check
    server app1_r3 127.0.0.1:9003 check
backend app2
    server app2_r1 127.0.0.1:9011 check
""")

MAINT, READY = 1, 0


def held(key: str, address: str, port: int | None, admin: int) -> ServerState:
    backend, name = key.split("/")
    return ServerState(backend, name, address, port, 0 if admin else 2, admin, 1)


@pytest.mark.parametrize(
    ("servers", "pending"),
    [
        # What the config says, nothing more: nothing pending.
        ([("app1/app1_r2", "127.0.0.1", 9002, READY), ("app1/app1_r3", "127.0.0.1", 9003, READY)], []),
        # Removed from the config, in maint at the placeholder: a removal left pending.
        ([("app1/app1_r1", "127.0.0.1", 1, MAINT), ("app1/app1_r2", "127.0.0.1", 9002, READY)], ["app1/app1_r1"]),
        # Several, in two backends.
        ([("app1/app1_r1", "127.0.0.1", 1, MAINT), ("app2/app2_r0", "127.0.0.1", 1, MAINT),
          ("app2/app2_r1", "127.0.0.1", 9011, READY)], ["app1/app1_r1", "app2/app2_r0"]),
        # In the config, in maint at the placeholder: the config's own (a name added back, say).
        ([("app1/app1_r2", "127.0.0.1", 1, MAINT)], []),
        # Not in the config, but not at the placeholder, or not in maint: not this daemon's removal.
        ([("app1/app1_r1", "127.0.0.1", 9001, MAINT)], []),
        ([("app1/app1_r1", "127.0.0.1", 1, READY)], []),
        ([("app1/app1_r1", "127.0.0.2", 1, MAINT)], []),
        # The same name in a backend that does not have it.
        ([("app2/app1_r2", "127.0.0.1", 1, MAINT)], ["app2/app1_r2"]),
    ],
)
def test_a_removal_left_pending_is_found_by_what_the_worker_holds(servers, pending):
    assert left_pending([held(*s) for s in servers], CONFIG) == pending
