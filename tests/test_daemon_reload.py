"""End to end, the daemon as a subprocess against the real HAProxy: watching and reloading."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from pathlib import Path

import pytest

from rigs.daemon import RequestLoop, http_get
from rigs.daemon import tagged_config as config
from rigs.harness import backends, free_port
from tests.support.faults import status

pytestmark = pytest.mark.haproxy


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def tag_of(front: int) -> str:
    status, headers, _ = await http_get(front)
    assert status == 200, status
    return headers.get("x-tag", "")


async def test_write_storm_gives_the_reloads_the_rules_allow(make):
    front = free_port()
    debounce_s, min_interval_s = 0.4, 4.0
    with backends("b1") as started:
        b1 = started["b1"].address
        d = make(
            config(front, b1, "start"),
            # No maximum wait: this test is about the debounce and the minimum interval alone.
            {"reload": {"debounce_ms": int(debounce_s * 1000), "min_interval_ms": int(min_interval_s * 1000),
                        "max_delay_ms": 60_000}},
        )
        d.start()
        await d.wait_generation(1)
        assert await tag_of(front) == "start"
        master_before = (await d.show_proc()).master
        assert master_before is not None

        # Phase 1: 300 writes in about 2 s, a few ms apart (far less than the debounce), many
        # of them partial: truncate-then-write in two steps, and half files left for a moment.
        final = config(front, b1, "final")
        started_at = time.monotonic()
        for i in range(300):
            text = config(front, b1, f"storm{i}")
            with d.rendered.open("w") as f:  # truncates
                if i % 3 == 0:
                    f.write(text[: len(text) // 2])  # half a file, visible on disk
                    f.flush()
                    os.fsync(f.fileno())
                    await asyncio.sleep(0.003)
                f.write(text[len(text) // 2 :] if i % 3 == 0 else text)
            if i % 7 == 0:
                d.rendered.write_text(text[: len(text) // 3])  # a half-written file
            await asyncio.sleep(0.004)
        d.rendered.write_text(final)
        assert time.monotonic() - started_at < 10

        await d.wait_log(r"reload ok generation=2")
        reload_seen = time.monotonic()
        assert await tag_of(front) == "final"
        # Exactly one reload for the whole storm: the master's own counter and our log agree.
        procs = await d.show_proc()
        assert procs.master is not None and procs.master.reloads == master_before.reloads + 1
        assert d.count(r"reload ok") == 1
        assert d.count(r"reload invalid") == 0, "a half-written file was validated: the debounce failed"
        assert "final" in (d.runtime / "haproxy.cfg").read_text()

        # Phase 2: three bursts, each further apart than the debounce (without the min interval
        # each would be a reload), all within min_interval of the first reload: one reload, of
        # the last burst's content, once the interval is over.
        for tag in ("b1", "b2", "b3"):
            for j in range(20):
                d.rendered.write_text(config(front, b1, f"{tag}-{j}") if j < 19 else config(front, b1, tag))
                await asyncio.sleep(0.003)
            await asyncio.sleep(debounce_s + 0.2)
        # Still well inside the interval (it began before `reload_seen`): nothing reloaded yet.
        if time.monotonic() - reload_seen < min_interval_s - 0.6:
            procs = await d.show_proc()
            assert procs.master is not None and procs.master.reloads == master_before.reloads + 1, "min interval"
        await d.wait_log(r"reload ok generation=3")
        assert time.monotonic() - reload_seen > min_interval_s - 0.6
        await asyncio.sleep(debounce_s + 0.3)
        procs = await d.show_proc()
        assert procs.master is not None and procs.master.reloads == master_before.reloads + 2
        assert d.count(r"reload ok") == 2
        assert await tag_of(front) == "b3"


async def test_broken_config_is_refused_while_traffic_flows_then_a_good_one_loads(make):
    front = free_port()
    with backends("b1") as started:
        b1 = started["b1"].address
        d = make(config(front, b1, "v1"), {"observe": {"enabled": True}})
        d.start()
        await d.wait_generation(1)
        effective = d.runtime / "haproxy.cfg"
        good_sha = sha(effective)
        loop = RequestLoop(front, max_requests=3000, max_seconds=20).start()
        await asyncio.sleep(0.3)
        d.write(config(front, b1, "v2").replace("backend app", "backend app\n    bogus_keyword here"))
        lines = await d.wait_log(r"reload invalid")
        assert "bogus_keyword" in lines[0], lines  # HAProxy's own words
        await asyncio.sleep(0.3)
        assert sha(effective) == good_sha, "the effective config on disk must stay the last good one"
        assert (await d.show_proc()).master.reloads == 0
        d.write(config(front, b1, "v3"))
        await d.wait_log(r"reload ok generation=2")
        await asyncio.sleep(0.3)
        results = await loop.stop()
    assert len(results) > 20, len(results)
    assert not loop.failures, loop.failures[:5]
    tags = [t for _, t in results]
    assert tags[0] == "v1" and tags[-1] == "v3" and "v2" not in tags


async def test_failed_reload_restores_the_last_good_config_and_the_next_good_one_loads(make):
    """`haproxy -c` passes but the new worker cannot bind: the master reports `failed`."""
    front, taken = free_port(), free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", taken))  # no SO_REUSEPORT: HAProxy's bind fails
    blocker.listen()
    try:
        with backends("b1") as started:
            b1 = started["b1"].address
            d = make(config(front, b1, "v1"), {"reload": {"timeout_s": 8}})
            d.start()
            worker = await d.wait_generation(1)
            effective = d.runtime / "haproxy.cfg"
            good = effective.read_text()
            d.write(config(front, b1, "v2").replace(f"bind 127.0.0.1:{front}", f"bind 127.0.0.1:{front}\n"
                                                    f"    bind 127.0.0.1:{taken}"))
            lines = await d.wait_log(r"reload failed")
            assert f"worker {worker} keeps serving" in lines[0], lines
            assert effective.read_text() == good
            procs = await d.show_proc()
            assert procs.current_worker is not None and procs.current_worker.pid == worker
            assert await tag_of(front) == "v1"
            d.write(config(front, b1, "v3"))
            await d.wait_log(r"reload ok generation=2")
            assert await tag_of(front) == "v3"
    finally:
        blocker.close()


async def test_unchanged_content_is_skipped_and_sighup_reloads_anyway(make):
    front = free_port()
    with backends("b1") as started:
        text = config(front, started["b1"].address, "v1")
        d = make(text)
        d.start()
        first = await d.wait_generation(1)
        d.write(text)  # same bytes, new inode
        await d.wait_log(r"reload skipped_unchanged")
        assert (await d.show_proc()).master.reloads == 0
        import signal

        d.signal(signal.SIGHUP)
        second = await d.wait_generation(2)
        assert second != first
        procs = await d.show_proc()
        assert procs.master.reloads == 1 and procs.current_worker.pid == second


async def test_configmap_symlink_swap_and_watched_map_file(make, rundir: Path):
    """Kubernetes' atomic writer (`..data` swapped) and a map in haproxy.watch both cause a reload."""
    front = free_port()
    mount = rundir / "cm"
    maps = rundir / "maps"
    maps.mkdir()
    (maps / "answers.map").write_text("/ one\n")
    template = (
        "global\n    hard-stop-after 5s\ndefaults\n    mode http\n    timeout connect 200ms\n"
        "    timeout client 5s\n    timeout server 5s\nfrontend fe\n    bind 127.0.0.1:{front}\n"
        "    http-after-response set-header x-tag {tag}\n"
        "    http-request return status 200 content-type text/plain lf-string "
        "\"%[path,map({maps}/answers.map,none)]\"\n"
    )

    def publish(version: str, tag: str) -> None:
        data = mount / f"..{version}"
        data.mkdir(parents=True)
        (data / "haproxy.cfg").write_text(template.format(front=front, tag=tag, maps=maps))
        tmp = mount / "..data_tmp"
        tmp.symlink_to(data.name)
        os.replace(tmp, mount / "..data")

    publish("v1", "cm1")
    (mount / "haproxy.cfg").symlink_to("..data/haproxy.cfg")
    d = make("", {"haproxy": {"watch": [str(maps)]}}, name="cm")
    d.settings_path.write_text(d.settings_path.read_text().replace(str(d.rendered), str(mount / "haproxy.cfg")))
    d.start()
    await d.wait_generation(1)
    status, headers, body = await http_get(front)
    assert (status, headers.get("x-tag"), body) == (200, "cm1", "one")

    publish("v2", "cm2")
    await d.wait_log(r"reload ok generation=2")
    status, headers, body = await http_get(front)
    assert (status, headers.get("x-tag"), body) == (200, "cm2", "one")

    # The effective config text does not change, the map it reads does: still a reload.
    tmp = maps / ".answers.map.swp"
    tmp.write_text("/ two\n")
    os.replace(tmp, maps / "answers.map")
    await d.wait_log(r"reload ok generation=3")
    status, _, body = await http_get(front)
    assert (status, body) == (200, "two")
    assert d.count(r"reload skipped_unchanged") == 0


async def test_invalid_config_at_start_waits_then_starts_on_a_valid_one(make):
    front = free_port()
    with backends("b1") as started:
        good = config(front, started["b1"].address, "late")
        d = make(good.replace("defaults", "defaults\n    no_such_thing 1"))
        d.start()
        await d.wait_log(r"no valid config to start haproxy")
        assert d.master_pid() is None
        d.write(good)
        await d.wait_generation(1)
        assert await tag_of(front) == "late"


async def test_rendered_config_directory_appearing_later_is_picked_up(make, rundir: Path):
    """A node where the controller has not rendered anything yet: the daemon waits, then starts."""
    front = free_port()
    with backends("b1") as started:
        d = make(config(front, started["b1"].address, "v1"), name="late")
        later = rundir / "not-yet" / "haproxy.cfg"
        d.settings_path.write_text(d.settings_path.read_text().replace(str(d.rendered), str(later)))
        d.start()
        await d.wait_log(r"cannot read rendered config")
        await d.wait_log(r"watch: .*not-yet missing")
        later.parent.mkdir()
        later.write_text(config(front, started["b1"].address, "v1"))
        await d.wait_generation(1)
        assert await tag_of(front) == "v1"
        # Nothing was wrong while the controller had rendered nothing: no invalid reload to alert on.
        assert (await status(d))["reloads"]["invalid"] == 0
        assert "reload invalid" not in d.run_log()
