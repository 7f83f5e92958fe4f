"""The garbage-collector policy: freezing after a reload leaks nothing, because what a
generation holds is freed by reference counting alone."""

from __future__ import annotations

import gc
import platform
from pathlib import Path

import pytest

from rigs.wholes import known_dead_servers, steer_entries
from supervisor.effective import build_effective
from supervisor.eventloop import collector_paused, settle_after_reload
from supervisor.haproxy.config import Config
from supervisor.settings import HAProxySettings, Settings
from supervisor.steering.dead import Sections

CORPUS = Path(__file__).parent / "corpus"


def cyclic_garbage_of(work) -> int:
    """How many objects `work()` left behind that only the cyclic collector can free."""
    gc.collect()
    gc.disable()
    try:
        work()
        return gc.collect()
    finally:
        gc.enable()


def test_a_generations_models_and_digests_are_freed_by_reference_counting(tmp_path: Path) -> None:
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path))
    texts = [p.read_text() for p in sorted(CORPUS.glob("*.cfg"))]

    def one_generation_each() -> None:
        cache = Sections()
        for text in texts:
            effective = build_effective(settings, text)
            model = effective.effective_model
            digest = cache.digest(model)
            dead = known_dead_servers(model, Config.parse(text), [], set())
            steer_entries(digest, dead, "fail-fast")
            del effective, model, digest

    assert cyclic_garbage_of(one_generation_each) == 0


def test_the_measure_sees_a_cycle() -> None:
    # The control: the check above would catch a model that refers back to itself.
    def make_cycle() -> None:
        loop: list[object] = []
        loop.append(loop)

    assert cyclic_garbage_of(make_cycle) >= 1


def test_settle_after_reload_freezes_what_is_alive() -> None:
    try:
        before = gc.get_freeze_count()
        kept = [[] for _ in range(100)]  # lists: objects the collector tracks
        settle_after_reload()
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()


def resident_anonymous_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_settle_after_reload_gives_the_kernel_back_the_heap_pages_freed() -> None:
    # Blocks over pymalloc's 512 bytes come from malloc, as a config's chunks and keys do; one
    # in a hundred stays alive, so the free pages sit inside the heap, not at its top.
    blocks = [bytes([1]) * 1000 for _ in range(80_000)]
    kept = blocks[::100]
    full = resident_anonymous_mb()
    del blocks
    freed = resident_anonymous_mb()
    try:
        settle_after_reload()
        settled = resident_anonymous_mb()
    finally:
        gc.unfreeze()
    # The control: freeing alone gives nothing back to the kernel.
    assert full - freed < 20, (full, freed)
    assert freed - settled > 50, (full, freed, settled)
    assert len(kept) == 800


def test_the_collector_is_paused_inside_and_left_as_found() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        garbage = [[] for _ in range(5 * gc.get_threshold()[0])]
        # Five times past the threshold, and no young collection reset the count.
        assert gc.get_count()[0] > 4 * gc.get_threshold()[0], (gc.get_count(), len(garbage))
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
