"""Fault: the rendered config's directory is a symlink that a deploy tool swaps.

`haproxy.config: .../deploy/current/haproxy.cfg`, where `current` points at a release
directory and `deploy` at a tree of releases; a deploy swaps a link (`ln -s v2 current.new &&
mv -T current.new current`). The daemon used to watch the directory the link pointed to at
start: it never saw the swap, served the old config for good with `converged: true`, and missed
the writes into the new directory as well. Now every symlink along the path is watched where it
lives, the file is watched where it really is, and a stat of the path (a hash when it changed)
is the safety net under them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from rigs.daemon import RequestLoop, tagged_config, write_atomic
from rigs.harness import backends, free_port
from supervisor.reloader.cycle import CONTENT_CHECK_S
from tests.support.faults import FAST_CONVERGE, Honesty, serving, wait_converged

pytestmark = pytest.mark.haproxy

CONVERGE_WITHIN_S = 8.0


def swap(link: Path, target: str) -> None:
    """`ln -s target link.new && mv -T link.new link`: one rename(2)."""
    new = link.with_name(link.name + ".new")
    os.symlink(target, new)
    os.replace(new, link)


async def test_a_swapped_release_link_and_writes_behind_it_are_loaded(make, rundir: Path):
    front = free_port()
    with backends("b1") as started:
        backend = started["b1"].address
        trees = rundir / "trees"
        for tree in ("a", "b"):
            for version in ("v1", "v2"):
                (trees / tree / version).mkdir(parents=True)
                (trees / tree / version / "haproxy.cfg").write_text(tagged_config(front, backend, f"{tree}-{version}"))
            (trees / tree / "current").symlink_to("v1")
        deploy = rundir / "deploy"
        deploy.symlink_to(trees / "a")
        config = deploy / "current" / "haproxy.cfg"
        d = make(tagged_config(front, backend, "unused"), FAST_CONVERGE)
        d.settings_path.write_text(d.settings_path.read_text().replace(str(d.rendered), str(config)))
        d.rendered = config  # what the helpers read: the path as HAProxy would
        d.start()
        await d.wait_generation(1)
        loop = RequestLoop(front, max_requests=4000, max_seconds=40).start()
        honesty = Honesty(d, front, grace_s=FAST_CONVERGE["reload"]["converge_grace_s"]).start()
        try:
            steps = []
            # 1. the release link swapped
            swap(trees / "a" / "current", "v2")
            steps.append(("swap current", await wait_converged(d, front, "a-v2", CONVERGE_WITHIN_S)))
            # 2. a write into the directory the link leads to now
            write_atomic(trees / "a" / "v2" / "haproxy.cfg", tagged_config(front, backend, "a-v2b"))
            steps.append(("write behind it", await wait_converged(d, front, "a-v2b", CONVERGE_WITHIN_S)))
            # 3. the link above it swapped: another tree, whose `current` is v1
            swap(deploy, str(trees / "b"))
            steps.append(("swap deploy", await wait_converged(d, front, "b-v1", CONVERGE_WITHIN_S)))
            # 4. the old tree's files change: nothing to do with what the path reads now
            write_atomic(trees / "a" / "v2" / "haproxy.cfg", tagged_config(front, backend, "stale"))
            # 5. an in-place write (close after write) in the new tree
            (trees / "b" / "v1" / "haproxy.cfg").write_text(tagged_config(front, backend, "b-v1b"))
            steps.append(("in-place write", await wait_converged(d, front, "b-v1b", CONVERGE_WITHIN_S)))
            await asyncio.sleep(1.5)  # the safety net's look, and the honesty samples on a settled file
        finally:
            await honesty.stop()
            await loop.stop()
    print("; ".join(f"{name} {took:.2f}s" for name, took in steps), f"; {honesty.samples} honesty samples")
    assert "stale" not in {tag for _, tag in loop.results}
    assert not honesty.lies, honesty.lies[:5]
    assert honesty.samples > 5
    assert not loop.failures, loop.failures[:5]
    assert d.count(r"with no event seen") == 0, "the watches saw every change; the safety net had nothing to do"
    assert d.count("Traceback") == 0


async def test_a_change_no_watch_can_see_is_found_by_the_safety_net(make, rundir: Path):
    """A bind mount over the rendered config's directory changes what the path reads without a
    single inotify event: the periodic look (stat, then hash) finds it."""
    # No event: the daemon can only know at its next look, at most a CONTENT_CHECK_S away.
    async with serving(make, settled_s=CONTENT_CHECK_S + 0.5) as node:
        d = node.daemon
        other = rundir / "other"
        other.mkdir()
        (other / "haproxy.cfg").write_text(tagged_config(node.front, node.backend, "mounted"))
        done = subprocess.run(["mount", "--bind", str(other), str(d.rendered.parent)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount (needs root): {done.stderr.strip()}")
        try:
            took = await wait_converged(d, node.front, "mounted", CONVERGE_WITHIN_S)
            await asyncio.sleep(1.0)
        finally:
            subprocess.run(["umount", "--lazy", str(d.rendered.parent)], capture_output=True, check=False)
    print(f"converged {took:.2f}s after the mount; {node.honesty.samples} honesty samples")
    assert d.count(r"watch: .* changed with no event seen; change scheduled") == 1
    assert not node.loop.failures, node.loop.failures[:5]
