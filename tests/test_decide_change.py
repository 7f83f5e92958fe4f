"""decide_change: what the reloader does with a change, as a table (no HAProxy)."""

from __future__ import annotations

import pytest

from supervisor.reloader.decisions import decide_change

A, B = "a" * 64, "b" * 64
IN1, IN2 = "inputs-1", "inputs-2"

# (current worker runs, goal, force, runtime apply plugged in) -> action
TABLE = [
    ((A, IN1), (A, IN1), False, True, "skip"),  # unchanged
    ((A, IN1), (A, IN1), False, False, "skip"),
    ((A, IN1), (A, IN1), True, True, "reload"),  # forced: reloads unchanged content, never at runtime
    ((A, IN1), (B, IN1), False, True, "runtime"),  # only the config changed
    ((A, IN1), (B, IN1), False, False, "reload"),  # no runtime apply plugged in
    ((A, IN1), (B, IN1), True, True, "reload"),
    ((A, IN1), (B, IN2), False, True, "reload"),  # a watched file changed: only a reload reads it
    ((A, IN1), (A, IN2), False, True, "reload"),
    ((A, None), (A, IN1), False, True, "reload"),  # what the worker was loaded with is unknown
    (None, (A, IN1), False, True, "reload"),  # no current worker
    (None, (A, IN1), True, False, "reload"),
]


@pytest.mark.parametrize(("current", "goal", "force", "runtime", "action"), TABLE)
def test_decide_change(current, goal, force, runtime, action):
    assert decide_change(current, goal, force=force, runtime_apply=runtime) == action
