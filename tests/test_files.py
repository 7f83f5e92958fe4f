"""Safe reads (regular files only, bounded) and safe writes (explicit modes, no symlink
followed, a runtime_dir of the daemon's own): issue 13, items 5 and 9."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigs.harness import ROOT
from supervisor.effective import RenderedConfigError, prepare_runtime_dir, read_rendered
from supervisor.files import UnsafeDirectory, ensure_private_dir, read_regular, write_atomically
from supervisor.settings import load_settings

NOBODY = 65534


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def returns_within(seconds: float, work) -> object:
    """work()'s result or exception, or fail when it is still blocked after `seconds` (the
    blocked thread is a daemon thread: it cannot hold the test run)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {seconds}s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


# ---------------------------------------------------------------- reads


def test_a_regular_file_is_read(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"global\n")
    assert read_regular(path) == b"global\n"


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    with pytest.raises(RenderedConfigError, match=r"fifo: cannot read rendered config: a FIFO, not a regular file$"):
        returns_within(2, lambda: read_rendered(path))


@pytest.mark.parametrize(("path", "kind"), [(Path("/dev/zero"), "a character device"), (None, "a directory")])
def test_devices_and_directories_are_refused(tmp_path, path, kind):
    path = path or tmp_path
    with pytest.raises(OSError, match=f"{kind}, not a regular file"):
        returns_within(2, lambda: read_regular(path))


def test_the_size_limit_is_enforced_before_reading(tmp_path):
    path = tmp_path / "big.cfg"
    path.write_bytes(b"#" * 1001)
    assert read_regular(path, limit=1001) == b"#" * 1001
    with pytest.raises(RenderedConfigError, match="1001 bytes, more than the limit of 1000"):
        read_rendered(path, limit=1000)


def test_the_limit_is_a_setting(tmp_path):
    settings = tmp_path / "s.yaml"
    settings.write_text("haproxy:\n  max_config_bytes: 4096\n")
    assert load_settings(settings, environ={}).haproxy.max_config_bytes == 4096


def test_a_non_utf8_rendered_config_is_one_line(tmp_path):
    path = tmp_path / "h.cfg"
    path.write_bytes("global\n".encode("utf-16"))
    with pytest.raises(RenderedConfigError, match="is UTF-16"):
        read_rendered(path)


# ---------------------------------------------------------------- runtime_dir


def test_runtime_dir_and_its_files_get_explicit_modes_under_umask_000(tmp_path):
    settings = _settings(tmp_path)
    with umask(0):
        prepare_runtime_dir(settings)
        write_atomically(settings.haproxy.effective_config, "global\n")
    h = settings.haproxy
    assert stat.S_IMODE(h.runtime_dir.stat().st_mode) == 0o750
    for path in (h.steer_map, h.server_state_file, h.effective_config):
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_runtime_dir_owned_by_another_user_is_refused(tmp_path):
    settings = _settings(tmp_path)
    settings.haproxy.runtime_dir.mkdir(mode=0o755)
    os.chown(settings.haproxy.runtime_dir, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match=f"owned by uid {NOBODY}, not by this daemon's uid 0"):
        prepare_runtime_dir(settings)
    assert not settings.haproxy.steer_map.exists()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_group_or_world_writable_runtime_dir_is_refused(tmp_path, mode):
    settings = _settings(tmp_path)
    settings.haproxy.runtime_dir.mkdir()
    os.chmod(settings.haproxy.runtime_dir, mode)
    with pytest.raises(UnsafeDirectory, match="lets other users write in it"):
        prepare_runtime_dir(settings)


def test_control_an_own_private_runtime_dir_is_used(tmp_path):
    settings = _settings(tmp_path)
    settings.haproxy.runtime_dir.mkdir(mode=0o700)
    prepare_runtime_dir(settings)
    assert settings.haproxy.steer_map.read_text() == ""


@pytest.mark.parametrize("dangling", [True, False])
def test_planted_symlinks_are_replaced_not_followed(tmp_path, dangling):
    settings = _settings(tmp_path)
    ensure_private_dir(settings.haproxy.runtime_dir)
    victim = tmp_path / "victim"
    if not dangling:
        victim.write_text("precious\n")
    for name in (settings.haproxy.steer_map, settings.haproxy.server_state_file, settings.haproxy.effective_config):
        name.symlink_to(victim)
    prepare_runtime_dir(settings)
    write_atomically(settings.haproxy.effective_config, "global\n")
    assert victim.exists() is not dangling
    if not dangling:
        assert victim.read_text() == "precious\n"
    for name in (settings.haproxy.steer_map, settings.haproxy.server_state_file, settings.haproxy.effective_config):
        assert stat.S_ISREG(name.lstat().st_mode), name


def test_check_refuses_an_unsafe_runtime_dir_in_one_line(tmp_path):
    rendered = tmp_path / "h.cfg"
    rendered.write_text("defaults\n    mode http\n")
    runtime = tmp_path / "run"
    runtime.mkdir()
    os.chmod(runtime, 0o777)
    path = tmp_path / "settings.yaml"
    path.write_text(f"haproxy:\n  config: {rendered}\n  runtime_dir: {runtime}\n")
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "check", "--config", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=30, check=False,
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{runtime}: cannot prepare runtime_dir: mode 0777 lets other users write in it" in result.stderr


def _settings(tmp_path: Path):
    path = tmp_path / "settings.yaml"
    path.write_text(f"haproxy:\n  runtime_dir: {tmp_path / 'run'}\n")
    return load_settings(path, environ={})


def test_a_fifo_as_the_token_file_does_not_hang_the_status_server(tmp_path, caplog):
    from supervisor.status.routes import load_token

    path = tmp_path / "token"
    os.mkfifo(path)
    token, problem = returns_within(2, lambda: load_token(path))
    assert token is None and "could not be read" in problem
    assert "a FIFO, not a regular file" in caplog.text
