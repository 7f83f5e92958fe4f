"""The stalled-connection detector without CAP_NET_ADMIN: the daemon says so once, in its log
and in /status, and aborts nothing. The control is the same daemon with the capability."""

from __future__ import annotations

import os
import shutil

import pytest

from rigs.daemon import tagged_config
from rigs.harness import backends, free_port
from tests.support.faults import metrics, status

pytestmark = pytest.mark.haproxy

WITHOUT_NET_ADMIN = ("setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin")
MISSING = "no CAP_NET_ADMIN, stalled sockets are not aborted"


def _net_admin(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as proc:
        effective = next(line for line in proc if line.startswith("CapEff:"))
    return bool(int(effective.split()[1], 16) >> 12 & 1)


@pytest.mark.parametrize("granted", [True, False], ids=["granted", "missing"])
async def test_a_missing_cap_net_admin_is_logged_once_and_shown(make, granted: bool):
    if not granted and shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to drop CAP_NET_ADMIN")
    if granted and not _net_admin(os.getpid()):
        pytest.skip("the test runner itself has no CAP_NET_ADMIN to grant")
    with backends("b1") as started:
        d = make(tagged_config(free_port(), started["b1"].address, "one"))
        d.start(through=() if granted else WITHOUT_NET_ADMIN)
        await d.wait_generation(1)
        assert _net_admin(d.pid) is granted
        detector = (await status(d))["detector"]
        assert detector["enabled"] is True
        assert detector["abort"] is granted, detector
        assert detector["abort_off_because"] == (None if granted else "no CAP_NET_ADMIN"), detector
        assert (await metrics(d))["haproxy_supervisor_detector_aborting"] == (1 if granted else 0)
        assert d.count(MISSING) == (0 if granted else 1), d.run_log()[-2000:]
