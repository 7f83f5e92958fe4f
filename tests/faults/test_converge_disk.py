"""Faults of the disk under runtime_dir: full, read-only, and full only where the daemon keeps
its own records (generations/) after HAProxy accepted a reload.

runtime_dir is a small tmpfs mounted by the test. HAProxy's worker is untouched: no request
may be lost. Each failed attempt is one log line (no traceback); /readyz says 503 once the
node has gone without the rendered config for longer than the grace period; once the disk
is usable again the node converges within the stated time without anyone touching it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rigs.daemon import Daemon, RequestLoop
from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port
from tests.support.faults import FAST_CONVERGE, fill, metrics, remount, status, tmpfs, wait_converged, wait_unready

pytestmark = pytest.mark.haproxy

# After the disk clears: the next attempt is at most reload.retry_max_s (1 s) away, plus a reload.
CONVERGE_WITHIN_S = 8.0


async def _fault_then_clear(d: Daemon, front: int, b1: str, fault: str) -> float:
    """Run `fault` ("full" or "ro") on runtime_dir across a write; returns the seconds the node
    took to converge after the fault cleared."""
    filler: Path | None = None
    if fault == "full":
        filler = fill(d.runtime)
    else:
        remount(d.runtime, "ro")
    try:
        d.write(config(front, b1, "v2"))
        expected = "No space left on device" if fault == "full" else "Read-only file system"
        lines = await d.wait_log(r"reload failed", timeout=10)
        assert expected in lines[0], lines
        reason = await wait_unready(d, timeout=10)
        assert "not converged" in reason and expected in reason, reason
        doc = await status(d)
        assert doc["convergence"]["converged"] is False and doc["convergence"]["transient"] is True
        assert doc["worker"]["pid"] == (await d.show_proc()).current_worker.pid
        await d.wait_log(r"converge: attempt 2", timeout=10)  # it keeps trying
    finally:
        if filler is not None:
            filler.unlink()
        else:
            remount(d.runtime, "rw")
    return await wait_converged(d, front, "v2", timeout=CONVERGE_WITHIN_S)


@pytest.mark.parametrize("fault", ["full", "ro"])
async def test_a_full_or_read_only_runtime_dir_delays_a_change_and_never_loses_it(make, fault: str):
    front = free_port()
    with backends("b1") as started:
        b1 = started["b1"].address
        d = make(config(front, b1, "v1"), FAST_CONVERGE)
        with tmpfs(d.runtime, size="2m"):
            d.start()
            await d.wait_generation(1)
            master = d.master_pid()
            loop = RequestLoop(front, max_requests=4000, max_seconds=40).start()
            await asyncio.sleep(0.3)
            took = await _fault_then_clear(d, front, b1, fault)
            await asyncio.sleep(0.3)
            results = await loop.stop()
            values = await metrics(d)
            assert master is not None and (await d.show_proc()).master.pid == master, "nothing was restarted"
            print(f"{fault}: converged {took:.2f}s after the fault cleared; {len(results)} requests")
            d.cleanup()
    assert values["haproxy_supervisor_converged"] == 1
    failed_lines = d.count(r"reload failed", whole=True)
    assert failed_lines >= 2, "each attempt is one log line"
    assert d.count("Traceback", whole=True) == 0, d.log()
    assert len(results) > 50, len(results)
    assert not loop.failures, loop.failures[:5]
    tags = [t for _, t in results]
    assert tags[0] == "v1" and tags[-1] == "v2" and set(tags) == {"v1", "v2"}


async def test_a_full_disk_for_the_records_after_haproxy_accepted_a_reload_changes_nothing_of_what_runs(make):
    """HAProxy loads the new config, then writing generations/N.cfg fails: what runs comes from
    `show proc`, so the daemon still knows the new worker as current (and the old one as old),
    and the change counts as loaded."""
    front = free_port()
    with backends("b1") as started:
        b1 = started["b1"].address
        d = make(config(front, b1, "v1"), FAST_CONVERGE)
        with tmpfs(d.runtime / "generations", size="64k"):
            d.start()
            await d.wait_generation(1)
            filler = fill(d.runtime / "generations")
            loop = RequestLoop(front, max_requests=4000, max_seconds=40).start()
            await asyncio.sleep(0.3)
            d.write(config(front, b1, "v2"))
            worker = await d.wait_generation(2)
            await wait_converged(d, front, "v2", timeout=CONVERGE_WITHIN_S)
            doc = await status(d)
            assert doc["worker"]["pid"] == worker == (await d.show_proc()).current_worker.pid
            assert doc["worker"]["generation"] == 2 and doc["reloads"]["ok"] == 1 and doc["reloads"]["failed"] == 0
            lines = await d.wait_log(r"cannot record generation 2's config")
            assert "No space left on device" in lines[0]
            # A second change while the disk is still full: still loaded, and the same condition
            # is not logged again.
            d.write(config(front, b1, "v3"))
            await d.wait_generation(3)
            await wait_converged(d, front, "v3", timeout=CONVERGE_WITHIN_S)
            filler.unlink()
            await asyncio.sleep(0.3)
            results = await loop.stop()
            d.cleanup()
    assert d.count(r"cannot record generation \d+'s config", whole=True) == 1, "one line per condition"
    assert d.count("Traceback", whole=True) == 0, d.log()
    assert not loop.failures, loop.failures[:5]
    tags = [t for _, t in results]
    assert tags[0] == "v1" and tags[-1] == "v3"
