"""Fault: the master CLI is crowded by another local client across a change.

HAProxy's master CLI serves a few connections at once; a local client holding many leaves the
daemon's `show proc` unanswered, and the reload is reported failed and retried with backoff.
Once the CLI answered again, the next attempt used to wait for the backoff to run out (15 s
in the report). Now the first answer from the CLI after a failure runs the pending attempt at
once. The worker is untouched: no request may fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import pytest

from tests.support.faults import crowd, serving, wait_converged

pytestmark = pytest.mark.haproxy

# A reload gives up on an unanswered `show proc` after 2 s; retries back off up to 30 s.
SETTINGS = {"reload": {"timeout_s": 2, "retry_max_s": 30, "converge_grace_s": 1}}
CROWD = 64
# The backoff the crowd is lifted at: an attempt this far off is what the old code waited for.
LIFT_AT_DELAY_S = 4.0
# After the crowd goes: housekeeping's next `show proc` (every second) and one reload.
CONVERGE_AFTER_LIFT_S = 3.0


async def test_a_pending_attempt_runs_as_soon_as_the_master_cli_answers_again(make):
    async with serving(make, SETTINGS) as node:
        d = node.daemon
        held = crowd(d, CROWD)
        try:
            node.write("v2")
            # Attempts fail and back off: 0.5 s, 1 s, 2 s, 4 s ...
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                delays = [float(m) for m in re.findall(r"attempt \d+ in ([\d.]+)s", d.run_log())]
                if delays and delays[-1] >= LIFT_AT_DELAY_S:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail(f"the crowd did not make the reloads fail\n{d.run_log()}")
        finally:
            for sock in held:
                with contextlib.suppress(OSError):
                    sock.close()
        lifted = time.monotonic()
        took = await wait_converged(d, node.front, "v2", timeout=20)
        await asyncio.sleep(0.5)
    print(f"{len(held)} connections held; converged {took:.2f}s after the crowd left (backoff {delays[-1]}s)")
    assert took < CONVERGE_AFTER_LIFT_S, f"waited for the backoff: {took:.2f}s\n{d.run_log()}"
    assert d.count(r"master CLI answers again: attempt \d+ now") >= 1
    assert time.monotonic() - lifted < 20
    assert not node.loop.failures, node.loop.failures[:5]
    assert d.count("Traceback") == 0
