"""The CI's HAProxy 3.0 build finds Debian's mirror in the machine's apt sources, never a
host name of its own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("haproxy_builds", ROOT / ".ci" / "haproxy_builds.py")
assert spec is not None and spec.loader is not None
builds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builds)


def test_mirrors_come_from_one_line_and_deb822_sources(tmp_path: Path):
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror-a.example/debian/ bookworm main\n"
        "deb-src http://mirror-a.example/debian bookworm main\n"
        "deb cdrom:[Debian]/ bookworm main\n"
    )
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    (parts / "debian.sources").write_text(
        "Types: deb\nURIs: https://mirror-b.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://mirror-b.example/debian-security\nSuites: bookworm-security\n"
    )
    (parts / "ignored.txt").write_text("deb http://not-a-source.example/debian bookworm main\n")
    assert builds.debian_mirrors((tmp_path / "sources.list", parts)) == [
        "http://mirror-a.example/debian",
        "https://mirror-b.example/debian",
        "http://mirror-b.example/debian-security",
    ]


def test_no_host_name_is_written_into_the_build():
    text = (ROOT / ".ci" / "haproxy_builds.py").read_text() + (ROOT / "Makefile").read_text()
    assert "debian.org" not in text
