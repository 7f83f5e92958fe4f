"""A render caught in the middle of Ray Serve's rebuild of an app waits for the next one
(runtime/plan.py: transient_render; reloader/decisions.py: TransientHold). Pure."""

from __future__ import annotations

import pytest

from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.plan import transient_render
from supervisor.reloader.decisions import TransientHold

# Ray Serve 2.60's render of two apps, cut to what the question needs (seen in bench.ray_drain).
RAY = """\
global
    stats socket /tmp/x/admin.sock mode 666 level admin expose-fd listeners
defaults
    mode http
    timeout connect 5s
    balance leastconn
frontend http_frontend
    bind *:8000
    acl is_http-wide path_beg /wide/
    http-request set-var-fmt(txn.serve_deployment) "Echo" if is_http-wide !{ var(txn.serve_deployment) -m found }
    use_backend http-wide if is_http-wide
    acl is_http-moved path_beg /moved/
    http-request set-var-fmt(txn.serve_deployment) "Echo" if is_http-moved !{ var(txn.serve_deployment) -m found }
    use_backend http-moved if is_http-moved
backend http-wide
    server SERVE_REPLICA_wide-Echo-a 127.0.0.1:30002 check
    server SERVE_REPLICA_wide-Echo-b 127.0.0.1:30004 check
    server SERVE_PROXY_ACTOR-fallback 127.0.0.1:8500 backup check
backend http-moved
    server SERVE_REPLICA_moved-Echo-a 127.0.0.1:30001 check
    server SERVE_REPLICA_moved-Echo-b 127.0.0.1:30003 check
    server SERVE_PROXY_ACTOR-fallback 127.0.0.1:8500 backup check
"""
MOVED_VAR = ('    http-request set-var-fmt(txn.serve_deployment) "Echo" if is_http-moved '
             '!{ var(txn.serve_deployment) -m found }\n')
MOVED_REPLICAS = ("    server SERVE_REPLICA_moved-Echo-a 127.0.0.1:30001 check\n"
                  "    server SERVE_REPLICA_moved-Echo-b 127.0.0.1:30003 check\n")


def without(text: str, *parts: str) -> str:
    for part in parts:
        assert part in text, part
        text = text.replace(part, "")
    return text


REBUILDING = without(RAY, MOVED_VAR, MOVED_REPLICAS)  # what Ray renders while it builds `moved` again
MOVED_DELETED = without(
    RAY, "    acl is_http-moved path_beg /moved/\n", MOVED_VAR, "    use_backend http-moved if is_http-moved\n",
    "backend http-moved\n" + MOVED_REPLICAS + "    server SERVE_PROXY_ACTOR-fallback 127.0.0.1:8500 backup check\n",
)


@pytest.mark.parametrize(("new", "transient"), [
    (REBUILDING, True),
    (without(RAY, MOVED_VAR), False),  # its servers stay: a real change, reloaded at once
    (without(RAY, MOVED_REPLICAS), False),  # servers only: the runtime API takes it
    (MOVED_DELETED, False),  # the app deleted with its routes
    (REBUILDING.replace("timeout connect 5s", "timeout connect 5s\n    timeout server 30s"), False),  # a line added
    (REBUILDING.replace("timeout connect 5s", "timeout connect 4s"), False),  # a line changed
    (RAY, False),
])
def test_transient_render_is_lines_taken_out_with_a_backend_emptied(new, transient):
    why = transient_render(Config.parse(RAY), Config.parse(new))
    assert (why is not None) == transient, why
    if transient:
        assert why.startswith("http-moved lost every primary server and only lines were taken out (")


def test_the_next_render_that_puts_them_back_is_not_transient():
    assert transient_render(Config.parse(REBUILDING), Config.parse(RAY)) is None


@pytest.mark.parametrize(("steps", "waits"), [
    # (render, now) in turn -> the waits; each render over RAY, the config that runs
    ([(REBUILDING, 10.0), (REBUILDING, 12.0), (REBUILDING, 15.0)], [5.0, 3.0, 0.0]),
    ([(REBUILDING, 10.0), (RAY, 11.0)], [5.0, 0.0]),  # the next render undid it
    ([(REBUILDING, 10.0), (REBUILDING, 13.0), (REBUILDING, 15.5)], [5.0, 2.0, 0.0]),  # in a row: from the first
    ([(REBUILDING, 10.0), (REBUILDING, 15.0), (REBUILDING, 16.0)], [5.0, 0.0, 5.0]),  # applied, then a new one
    ([(REBUILDING, 10.0), (RAY, 11.0), (REBUILDING, 12.0)], [5.0, 0.0, 5.0]),
])
def test_transient_hold_waits_from_the_first_of_a_row(steps, waits):
    hold, running = TransientHold(5.0), Config.parse(RAY)
    assert [hold.check(running, Config.parse(new), now)[0] for new, now in steps] == waits


def test_transient_hold_zero_never_waits_and_a_forced_cycle_is_not_held():
    assert TransientHold(0).check(Config.parse(RAY), Config.parse(REBUILDING), 1.0) == (0.0, None)
    assert TransientHold(5).check(None, Config.parse(REBUILDING), 1.0) == (0.0, None)
    wait, why = TransientHold(5).check(Config.parse(RAY), Config.parse(REBUILDING), 1.0)
    assert wait == 5.0 and why is not None
