"""Control for issue 31's first cause, with HAProxy alone: a pooled idle server connection to a
server that vanished takes the next request balanced to it, and with `http-reuse always` and no
`timeout server` (Ray Serve's template) that request gets no answer, while the kernel shows
the connection ESTABLISHED with its request unacknowledged (Send-Q) under a retransmit or
persist timer."""

from __future__ import annotations

import shutil

import pytest

from rigs.harness import short_tmpdir
from rigs.ray_serve import run_scenario
from tests.support.pooled_hang import CLIENT_TIMEOUT_S

pytestmark = pytest.mark.skipif(
    not (shutil.which("unshare") and (shutil.which("nft") or shutil.which("/usr/sbin/nft"))),
    reason="needs unshare and nftables",
)


def test_control_a_request_on_a_pooled_connection_to_a_vanished_server_hangs():
    directory = short_tmpdir("hs-ph-")
    try:
        found = run_scenario("tests.support.pooled_hang", ["--dir", str(directory)], 120, directory / "run.log")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert found["served"] == ["r1", "r2", "r1", "r2"], found
    assert any(s.startswith("ESTAB") for s in found["pooled_before"]), found["pooled_before"]
    hung = [a for a in found["answers"] if a[0] == 0]
    answered = [a for a in found["answers"] if a[0] == 200]
    # Round robin sends half the requests to r1: the one that reuses the pooled connection hangs;
    # one that connects anew pays `timeout connect 1s`, then redispatch takes it to r2.
    assert hung and all(a[2] >= CLIENT_TIMEOUT_S - 0.1 for a in hung), found["answers"]
    assert answered and all(a[1] == "r2" and a[2] < 1.5 for a in answered), found["answers"]
    stuck = [s for s in found["during"] if s.startswith("ESTAB") and "Send-Q 0" not in s]
    assert stuck and all("timer:(on," in s or "timer:(persist," in s for s in stuck), found["during"]
