"""The steering as a pipeline: decide (dead, entries, plan), diff (mapdiff), wire (lines),
and the shell that applies what pushes and read-backs return. Pure parts, with tables."""

from __future__ import annotations

from unittest import mock

from supervisor.effective import build_effective
from supervisor.haproxy.config import Config
from supervisor.settings import HAProxySettings, Settings
from supervisor.steering.digests import Digests

RENDERED = """\
global
    hard-stop-after 5s
defaults
    mode http
    timeout connect 200ms
    timeout client 5s
    timeout server 5s
frontend fe
    bind 127.0.0.1:8080
    default_backend app
backend app
{servers}
"""


def effective_of(tmp_path, servers: list[str]):
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path / "run"))
    lines = "\n".join(f"    server {name} 127.0.0.1:{9000 + i}" for i, name in enumerate(servers))
    return build_effective(settings, RENDERED.format(servers=lines))


def test_an_effective_config_is_digested_by_its_sha256_without_rendering_it(tmp_path):
    effective = effective_of(tmp_path, ["r1", "r2"])
    same = effective_of(tmp_path, ["r1", "r2"])  # the same content in another object
    digests = Digests()
    with mock.patch.object(Config, "render", side_effect=AssertionError("rendered again")):
        first = digests.of_effective(effective)
        again = digests.of_effective(same)  # found by its sha256
    assert again is first
    assert first.sections["app"].by_name.keys() == {"r1", "r2"}
    other = digests.of_effective(effective_of(tmp_path, ["r2"]))
    assert other.key != first.key
