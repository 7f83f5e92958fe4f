"""Issue #34's measure of the code's shape, on the real daemon: one reload's new config
followed call by call (tests/support/call_path.py). No call goes from a lower layer up into a
higher one, and the config enters a module it had already entered no more often than today."""

from __future__ import annotations

from rigs.netns import needs_netns, run_in_netns
from tests.support.call_path import follow_a_reload

pytestmark = needs_netns

# Today's count, the bound: the records get the config before the reload and once after
# it, the steering digests it in prepare and once after, and HAProxy's config model is read
# three times more (steering's digest, the server-state file).
AT_MOST_AGAIN = 5


def test_a_reloads_config_goes_down_the_layers_and_seldom_back():
    found = run_in_netns(follow_a_reload, timeout=90)
    path = "\n".join(f"{caller} -> {callee} {name}" for caller, callee, name in found["path"])
    assert len(found["path"]) >= 8, path  # the path was followed at all: check, steering, record
    assert found["up"] == [], path
    assert len(found["again"]) <= AT_MOST_AGAIN, path
