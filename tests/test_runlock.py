"""The runtime_dir lock: one holder at a time, named when refused, renewed with a new runtime_dir."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from supervisor.files import RuntimeDirInUse, RuntimeDirLock


def test_a_second_lock_is_refused_and_names_the_holder(tmp_path: Path):
    first = RuntimeDirLock(tmp_path)
    first.acquire()
    second = RuntimeDirLock(tmp_path)  # another open file description: flock conflicts, as between processes
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeDirInUse) as refused:
        second.acquire()
    assert f"PID {os.getpid()}" in refused.value.strerror and str(tmp_path) in refused.value.strerror
    assert len(os.listdir("/proc/self/fd")) == descriptors  # the refused attempt keeps no descriptor
    first.release()
    second.acquire()  # released: the next one gets it
    with pytest.raises(RuntimeDirInUse):
        RuntimeDirLock(tmp_path).acquire()
    second.release()


def test_the_holder_comes_from_the_kernel_not_only_from_the_file(tmp_path: Path):
    lock = RuntimeDirLock(tmp_path)
    lock.acquire()
    lock.path.write_text("999999\n")  # a stale or forged PID in the file
    with pytest.raises(RuntimeDirInUse) as refused:
        RuntimeDirLock(tmp_path).acquire()
    assert f"PID {os.getpid()}" in refused.value.strerror
    lock.release()


def test_a_runtime_dir_made_again_is_locked_again(tmp_path: Path):
    runtime = tmp_path / "run"
    runtime.mkdir()
    lock = RuntimeDirLock(runtime)
    lock.acquire()
    shutil.rmtree(runtime)
    runtime.mkdir()
    lock.renew()
    with pytest.raises(RuntimeDirInUse):
        RuntimeDirLock(runtime).acquire()
    lock.release()
    RuntimeDirLock(runtime).acquire()
