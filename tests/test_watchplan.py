"""What is watched for a path (through every symlink), and what each inotify event means."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from supervisor.reloader.watch import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    Event,
    Interest,
    classify,
    parse_events,
    plan_watches,
)


def release_tree(root: Path) -> Path:
    """deploy -> trees/a; trees/a/current -> v1; the config path goes through both links."""
    for tree in ("a", "b"):
        for version in ("v1", "v2"):
            (root / "trees" / tree / version).mkdir(parents=True)
            (root / "trees" / tree / version / "haproxy.cfg").write_text(f"{tree} {version}\n")
        (root / "trees" / tree / "current").symlink_to("v1")
    (root / "deploy").symlink_to(root / "trees" / "a")
    return root / "deploy" / "current" / "haproxy.cfg"


def test_every_symlink_along_the_path_is_watched_where_it_lives(tmp_path: Path):
    config = release_tree(tmp_path)
    plan = plan_watches([config], [])
    assert plan.resolved[config] == tmp_path / "trees" / "a" / "v1" / "haproxy.cfg"
    assert plan.directories[tmp_path].path_names == {"deploy"}
    assert plan.directories[tmp_path / "trees" / "a"].path_names == {"current"}
    assert plan.directories[tmp_path / "trees" / "a" / "v1"].file_names == {"haproxy.cfg"}
    assert not plan.missing
    # The swap of the inner link: the plan follows it.
    (tmp_path / "trees" / "a" / "next").symlink_to("v2")
    os.replace(tmp_path / "trees" / "a" / "next", tmp_path / "trees" / "a" / "current")
    assert plan_watches([config], []).resolved[config] == tmp_path / "trees" / "a" / "v2" / "haproxy.cfg"


def test_a_configmap_mount_watches_its_data_link_and_the_real_file(tmp_path: Path):
    mount = tmp_path / "cfg"
    (mount / "..2024_01").mkdir(parents=True)
    (mount / "..2024_01" / "haproxy.cfg").write_text("x")
    (mount / "..data").symlink_to("..2024_01")
    (mount / "haproxy.cfg").symlink_to("..data/haproxy.cfg")
    plan = plan_watches([mount / "haproxy.cfg"], [])
    assert plan.directories[mount].path_names == {"haproxy.cfg", "..data"}
    assert plan.directories[mount / "..2024_01"].file_names == {"haproxy.cfg"}


def test_a_missing_directory_is_awaited_and_a_missing_file_is_content(tmp_path: Path):
    plan = plan_watches([tmp_path / "later" / "haproxy.cfg", tmp_path / "x.map"], [])
    assert plan.missing == [tmp_path / "later"]
    assert plan.directories[tmp_path].path_names == {"later"}
    assert plan.directories[tmp_path].file_names == {"x.map"}


def test_a_watched_directory_is_watched_with_its_subdirectories_but_not_runtime_dir(tmp_path: Path):
    maps = tmp_path / "maps"
    (maps / "sub").mkdir(parents=True)
    (maps / "run").mkdir()
    plan = plan_watches([tmp_path / "h.cfg"], [maps], ignore=[maps / "run"])
    assert plan.directories[maps].every_file and plan.directories[maps / "sub"].every_file
    assert maps / "run" not in plan.directories and plan.directories[maps].ignore == {"run"}


def test_a_symlink_loop_resolves_to_nothing(tmp_path: Path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    plan = plan_watches([tmp_path / "a" / "h.cfg"], [])
    assert plan.resolved == {} and plan.directories[tmp_path].path_names == {"a", "b"}


FILE = Interest(file_names={"haproxy.cfg"})
LINKS = Interest(path_names={"current"})
TREE = Interest(every_file=True, ignore={"run"})


@pytest.mark.parametrize(
    ("interest", "mask", "name", "is_link", "meaning"),
    [
        # the file: a completed write or a rename into place is a change; a write in progress is not
        (FILE, IN_CLOSE_WRITE, "haproxy.cfg", False, "change"),
        (FILE, IN_MOVED_TO, "haproxy.cfg", False, "change"),
        (FILE, IN_MODIFY, "haproxy.cfg", False, "writing"),
        (FILE, IN_CREATE, "haproxy.cfg", False, "writing"),  # created, not yet closed
        (FILE, IN_CREATE, "haproxy.cfg", True, "replan"),  # `ln -sf`: whole at once, and leads elsewhere
        (FILE, IN_DELETE, "haproxy.cfg", False, "change"),
        (FILE, IN_MOVED_FROM, "haproxy.cfg", False, "change"),
        (FILE, IN_CLOSE_WRITE, ".haproxy.cfg.swp", False, "ignore"),
        (FILE, IN_MOVED_TO, "other.cfg", False, "ignore"),
        # a symlink along the path: any change of the entry re-plans
        (LINKS, IN_MOVED_TO, "current", False, "replan"),  # mv -T current.new current
        (LINKS, IN_CREATE, "current", True, "replan"),
        (LINKS, IN_DELETE, "current", False, "replan"),
        (LINKS, IN_CREATE, "current.new", True, "ignore"),
        (LINKS, IN_CLOSE_WRITE, "current", False, "ignore"),
        # the directory itself goes away or moves, the kernel drops the watch, events were lost
        (FILE, IN_DELETE_SELF, "", False, "replan"),
        (FILE, IN_IGNORED, "", False, "replan"),
        (None, IN_IGNORED, "", False, "ignore"),  # a watch no longer planned
        (None, IN_Q_OVERFLOW, "", False, "replan"),
        # a watched directory: every file, and new subdirectories
        (TREE, IN_CLOSE_WRITE, "hosts.map", False, "change"),
        (TREE, IN_MOVED_TO, "..data", False, "change"),
        (TREE, IN_CREATE | IN_ISDIR, "sub", False, "replan"),
        (TREE, IN_CLOSE_WRITE, "run", False, "ignore"),
    ],
)
def test_what_an_event_means(interest, mask, name, is_link, meaning):
    assert classify(interest, mask, name, is_link) == meaning


def test_events_are_parsed_from_one_read():
    def packed(wd: int, mask: int, name: bytes) -> bytes:
        padded = name + b"\0" * (16 - len(name)) if name else b""
        return struct.pack("iIII", wd, mask, 0, len(padded)) + padded

    data = packed(1, IN_CLOSE_WRITE, b"haproxy.cfg") + packed(2, IN_IGNORED, b"") + packed(3, IN_MOVED_TO, b"..data")
    assert parse_events(data) == [
        Event(1, IN_CLOSE_WRITE, "haproxy.cfg"), Event(2, IN_IGNORED, ""), Event(3, IN_MOVED_TO, "..data"),
    ]
