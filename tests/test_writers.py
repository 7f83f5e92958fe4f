"""Reading a file only once its writer is done: locks on <file>.lock and the file, a file open
for writing, a change during the read; and the safety net's rule for news."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.files import WriterBusy, lock_file, read_whole
from supervisor.reloader.watch import content_news


def test_a_file_nobody_writes_is_read(tmp_path: Path):
    path = tmp_path / "haproxy.cfg"
    path.write_text("global\n")
    assert read_whole(path) == b"global\n"


def test_an_exclusive_flock_on_the_lock_file_or_the_file_holds_the_read(tmp_path: Path):
    path = tmp_path / "haproxy.cfg"
    path.write_text("global\n")
    for locked in (lock_file(path), path):
        locked.touch()
        fd = os.open(locked, os.O_RDONLY)  # another open file description: conflicts like another process
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with pytest.raises(WriterBusy, match="locked by its writer"):
                read_whole(path)
            fcntl.flock(fd, fcntl.LOCK_SH)  # a reader's shared lock is no writer
            assert read_whole(path) == b"global\n"
        finally:
            os.close(fd)
    assert read_whole(path) == b"global\n"


def test_a_posix_write_lock_held_by_another_process_holds_the_read(tmp_path: Path):
    path = tmp_path / "haproxy.cfg"
    path.write_text("global\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys\n"
         f"f = open({str(lock_file(path))!r}, 'w')\nfcntl.lockf(f, fcntl.LOCK_EX)\nprint('held', flush=True)\n"
         "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(WriterBusy, match=f"PID {holder.pid}, fcntl"):
            read_whole(path)
    finally:
        holder.communicate("", timeout=10)
    assert read_whole(path) == b"global\n"


def test_a_file_open_for_writing_is_not_read(tmp_path: Path):
    path = tmp_path / "haproxy.cfg"
    path.write_text("global\n")
    with path.open("a") as writer:
        writer.write("defaults\n")
        writer.flush()
        with pytest.raises(WriterBusy, match="open for writing"):
            read_whole(path)
    assert read_whole(path) == b"global\ndefaults\n"


def test_a_missing_lock_file_is_no_lock_and_a_missing_file_is_unreadable(tmp_path: Path):
    with pytest.raises(OSError) as missing:
        read_whole(tmp_path / "haproxy.cfg")
    assert not isinstance(missing.value, WriterBusy)
    assert not lock_file(tmp_path / "haproxy.cfg").exists(), "the lock file is the writer's, never made here"


@pytest.mark.parametrize(
    ("look", "previous", "read", "news"),
    [
        ("b", "a", "a", True),  # changed, and no cycle read it: news
        ("b", "a", "b", False),  # changed, and the cycle the watches started read it already
        ("a", "a", "a", False),
        ("a", "a", "z", False),  # the last look's news already
        (None, "a", "a", True),  # gone
        (None, None, "a", False),
    ],
)
def test_what_the_safety_net_calls_news(look, previous, read, news):
    assert content_news(look, previous, read) is news
