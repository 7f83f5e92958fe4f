"""The Ray suite's RenderLog (tests/support/ray_churn.py), on config files written here the way
Ray's HAProxyManager writes its own: truncated and rewritten in place under an exclusive flock
on `<config>.lock`. It must tell a change of server lines from a change beyond them, say what
changed, and never take a torn write for a render."""

from __future__ import annotations

import contextlib
import fcntl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.support.ray_churn import RenderLog, read_whole_render


def config(servers: list[str], timeout_connect: str = "5s") -> str:
    lines = ["global", "    nbthread 4", "defaults", f"    timeout connect {timeout_connect}",
             "backend http-app", "    option httpchk GET /-/healthz"]
    lines += [f"    server SERVE_REPLICA_app-Ingress-{name} 127.0.0.1:{30000 + i} check"
              for i, name in enumerate(servers)]
    lines += ["    # Fallback to head node's Serve proxy when no ingress replicas are available",
              "    server fallback 127.0.0.1:8500 check backup"]
    # Long enough to span pages: a torn read ends at a page boundary.
    lines += [f"    # filler {i:04d} {'x' * 60}" for i in range(200)]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def ray_lock(path: Path) -> Iterator[None]:
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_like_ray(path: Path, text: str) -> None:
    with ray_lock(path), open(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def torn_write(path: Path, text: str) -> Iterator[tuple[str, IO[str]]]:
    """Ray's write caught half done: the lock held, the file truncated and holding the first half
    of `text`. Yields (that half, the open file); the second half is written on leaving."""
    half = text[: len(text) // 2]
    with ray_lock(path), open(path, "w") as f:
        f.write(half)
        f.flush()
        yield half, f
        f.write(text[len(half):])


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def log(tmp_path: Path) -> Iterator[RenderLog]:
    path = tmp_path / "haproxy.cfg"
    write_like_ray(path, config(["a", "b"]))
    renders = RenderLog(path)
    renders.start()
    wait_until(lambda: len(renders.renders) == 1, "the first render")
    yield renders
    renders.stop()


def rendered(log: RenderLog, text: str) -> tuple[int, str]:
    """Write `text` as Ray would; what log.in_window says about that write."""
    started = time.monotonic()
    count = len(log.renders)
    write_like_ray(log.path, text)
    wait_until(lambda: len(log.renders) > count, "the new render")
    return log.in_window(started, time.monotonic())


def changed_lines(diff: str) -> list[str]:
    return [line for line in diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))]


def test_a_change_of_server_lines_only_is_no_change_beyond_servers(log: RenderLog) -> None:
    assert rendered(log, config(["c", "d", "e"])) == (1, "")
    assert rendered(log, config([])) == (1, "")


def test_a_change_beyond_servers_is_told_with_its_diff(log: RenderLog) -> None:
    renders, diff = rendered(log, config(["c"], timeout_connect="6s"))
    assert renders == 1
    assert changed_lines(diff) == ["-    timeout connect 5s", "+    timeout connect 6s"]


def test_a_change_beyond_servers_before_a_change_back_still_counts(log: RenderLog) -> None:
    started = time.monotonic()
    write_like_ray(log.path, config(["a"], timeout_connect="6s"))
    wait_until(lambda: len(log.renders) == 2, "the changed render")
    write_like_ray(log.path, config(["a"]))
    wait_until(lambda: len(log.renders) == 3, "the render changed back")
    renders, diff = log.in_window(started, time.monotonic())
    assert renders == 2
    assert changed_lines(diff) == ["-    timeout connect 5s", "+    timeout connect 6s"]


def test_a_torn_write_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "haproxy.cfg"
    whole = config(["a", "b"])
    write_like_ray(path, config(["a"]))
    read: list[str] = []
    with torn_write(path, whole) as (half, _):
        # What a read outside Ray's lock gets: the control.
        assert path.read_text() == half
        reader = threading.Thread(target=lambda: read.append(read_whole_render(path)), daemon=True)
        reader.start()
        reader.join(0.5)
        assert read == [], "read a write still under way"
    reader.join(5)
    assert read == [whole]


def test_the_render_log_skips_a_torn_write(log: RenderLog) -> None:
    whole = config(["c"], timeout_connect="6s")
    started = time.monotonic()
    with torn_write(log.path, whole):
        # The log polls every 20 ms: a read it could make outside the lock, it has made by now.
        time.sleep(0.3)
    wait_until(lambda: len(log.renders) == 2, "the whole render")
    renders, diff = log.in_window(started, time.monotonic())
    assert renders == 1
    assert changed_lines(diff) == ["-    timeout connect 5s", "+    timeout connect 6s"]
