"""The Ray bridge's pure parts: Ray's command lines, the verdicts over /status, the hold-back
rule, and the `show info` rewrite. End to end: tests/test_ray_bridge_e2e.py."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from supervisor.haproxy.config import Config
from supervisor.ray_bridge import (
    Bridge,
    BridgeError,
    PassThrough,
    Refused,
    Run,
    Running,
    UsageError,
    Waiting,
    asks_show_info,
    handover_verdict,
    hard_stop_after_s,
    hold_back_reason,
    parse_argv,
    primary_server_count,
    serving_config,
    serving_mine,
    socket_mode,
    with_pid,
    without_hand_off_rows,
)
from supervisor.settings import HAProxySettings, Settings

CFG = "/tmp/haproxy-serve/n1/haproxy.cfg"
SOCK = "/tmp/haproxy-serve/n1/admin.sock"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["-db", "-f", CFG, "-dR"], Run(Path(CFG)), id="ray-start"),
        pytest.param(["-db", "-f", CFG], Run(Path(CFG)), id="ray-start-reuse-port"),
        pytest.param(
            ["-db", "-f", CFG, "-dR", "-sf", "101", "99", "98", "-x", SOCK],
            Run(Path(CFG), (101, 99, 98), ()),
            id="ray-reload",
        ),
        pytest.param(["-db", "-f", CFG, "-sf", "101"], Run(Path(CFG), (101,)), id="ray-reload-no-optimised-config"),
        pytest.param(["-db", "-f", CFG, "-st", "7", "-x", SOCK], Run(Path(CFG), (), (7,)), id="hard"),
        pytest.param(["-v"], PassThrough(("-v",)), id="version"),
        pytest.param(["-vv"], PassThrough(("-vv",)), id="build-options"),
        pytest.param(["-c", "-f", CFG], PassThrough(("-c", "-f", CFG)), id="check"),
        pytest.param([], PassThrough(()), id="usage"),
    ],
)
def test_ray_command_lines(argv: list[str], expected: Run | PassThrough):
    assert parse_argv(argv) == expected


def test_a_reload_is_told_from_a_start():
    assert not parse_argv(["-db", "-f", CFG, "-dR"]).replaces  # type: ignore[union-attr]
    assert parse_argv(["-db", "-f", CFG, "-dR", "-sf", "5", "-x", SOCK]).replaces  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["-db", "-f"], "option -f needs an argument"),
        (["-db", "-f", CFG, "-f", CFG], "exactly one config"),
        (["-db", "-dR"], "exactly one config"),
        (["-db", "-f", CFG, "--frobnicate"], "unknown option '--frobnicate'"),
        (["-D", "-f", CFG], "daemon mode"),
    ],
)
def test_command_lines_refused(argv: list[str], error: str):
    with pytest.raises(UsageError, match=error):
        parse_argv(argv)


# ---------------------------------------------------------------- /status verdicts

MINE, OTHER = "a" * 64, "b" * 64
WROTE = datetime(2026, 12, 1, 9, 0, 0, 123456, tzinfo=UTC)


def doc(
    read: str | None = MINE, runs: str | None = MINE, converged: bool = True, up: bool = True,
    transient: bool = True, last: dict[str, Any] | None = None, old: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "haproxy": {"up": up},
        "worker": {"pid": 4242 if runs else None, "generation": 3, "rendered_sha256": runs},
        "config": {"rendered_sha256": read, "rendered_path": "/x"},
        "convergence": {"converged": converged, "transient": transient, "reason": None if converged else "why"},
        "reloads": {"last": last},
        "old_workers": old or [],
    }


INVALID_AFTER = {"at": "2026-12-01T09:00:00.124Z", "result": "invalid", "error": "[ALERT] parsing: unknown keyword"}
INVALID_SAME_MS = {**INVALID_AFTER, "at": "2026-12-01T09:00:00.123Z"}
INVALID_BEFORE = {**INVALID_AFTER, "at": "2026-12-01T08:59:59.000Z"}
REFUSED_RELOAD = {"at": "2026-12-01T09:00:01.000Z", "result": "failed", "error": "cannot bind socket [127.0.0.1:80]"}


@pytest.mark.parametrize(
    ("document", "written_at", "expected"),
    [
        pytest.param(doc(), WROTE, Running(4242, 3, MINE), id="runs-it"),
        pytest.param(doc(read=OTHER, runs=OTHER), WROTE, Waiting("the daemon has not read the config yet"),
                     id="not-read-yet"),
        pytest.param(doc(runs=OTHER, converged=False), WROTE, Waiting("why"), id="read-not-run"),
        # The worker runs it, but the daemon is not converged (a change pending): not yet.
        pytest.param(doc(converged=False), WROTE, Waiting("why"), id="runs-but-not-converged"),
        pytest.param(doc(up=False, runs=None, converged=False), WROTE,
                     Waiting("the daemon's HAProxy master is not running"), id="master-down"),
        pytest.param(doc(runs=OTHER, converged=False, transient=False, last=INVALID_AFTER), WROTE,
                     Refused("[ALERT] parsing: unknown keyword"), id="invalid"),
        pytest.param(doc(runs=OTHER, converged=False, transient=False, last=INVALID_SAME_MS), WROTE,
                     Refused("[ALERT] parsing: unknown keyword"), id="invalid-same-millisecond"),
        # The daemon's first start, with nothing it could run yet.
        pytest.param(doc(runs=None, up=False, converged=False, transient=False, last=INVALID_AFTER), WROTE,
                     Refused("[ALERT] parsing: unknown keyword"), id="invalid-first-config"),
        pytest.param(doc(runs=OTHER, converged=False, transient=False, last=REFUSED_RELOAD), WROTE,
                     Refused("cannot bind socket [127.0.0.1:80]"), id="refused-by-haproxy"),
        # A verdict from before the write is about an earlier text: wait for this one's.
        pytest.param(doc(runs=OTHER, converged=False, transient=False, last=INVALID_BEFORE), WROTE,
                     Waiting("why"), id="stale-verdict"),
        # Not written (the same text was there): the daemon judged it already, and will not again.
        pytest.param(doc(runs=OTHER, converged=False, transient=False, last=INVALID_BEFORE), None,
                     Refused("[ALERT] parsing: unknown keyword"), id="same-text-judged-before"),
        # A failure that passes is retried by the daemon: wait.
        pytest.param(doc(runs=OTHER, converged=False, transient=True, last=REFUSED_RELOAD), WROTE,
                     Waiting("why"), id="transient-failure"),
    ],
)
def test_handover_verdict(document: dict[str, Any], written_at: datetime | None, expected: object):
    assert handover_verdict(document, MINE, written_at) == expected


def test_serving_config_is_whatever_the_worker_runs():
    assert serving_config(doc(read=OTHER, runs=OTHER)) == Running(4242, 3, OTHER)
    assert isinstance(serving_config(doc(up=False)), Waiting)
    assert isinstance(serving_config(doc(runs=None)), Waiting)


def test_serving_mine_lists_the_old_workers_of_this_config():
    old = [
        {"pid": 12, "generation": 2, "rendered_sha256": MINE},
        {"pid": 11, "generation": 1, "rendered_sha256": OTHER},
        {"pid": 10, "generation": None, "rendered_sha256": None},
        {"pid": 9, "generation": 1, "rendered_sha256": MINE},
    ]
    assert serving_mine(doc(old=old), MINE) == [9, 12]
    assert serving_mine(doc(old=old), "c" * 64) == []
    assert serving_mine(doc(), MINE) == []  # the current worker is not an old one


# ---------------------------------------------------------------- holding an empty config back

WITH_SERVERS = Config.parse(
    "backend a\n    server r1 127.0.0.1:1 check\n    server fb 127.0.0.1:9 check backup\n"
)
BACKUP_ONLY = Config.parse(
    "backend a\n    server fb 127.0.0.1:9 check backup\nbackend b\n    server fb 127.0.0.1:9 backup\n"
)
NO_BACKENDS = Config.parse("frontend f\n    bind 127.0.0.1:1\n")


def test_primary_servers_leave_backups_out():
    assert [primary_server_count(c) for c in (WITH_SERVERS, BACKUP_ONLY, NO_BACKENDS)] == [1, 0, 0]


@pytest.mark.parametrize(
    ("replaces", "mine", "in_place", "held"),
    [
        pytest.param(False, BACKUP_ONLY, WITH_SERVERS, True, id="fresh-manager-backup-only"),
        pytest.param(False, NO_BACKENDS, WITH_SERVERS, True, id="fresh-manager-no-backends"),
        pytest.param(True, BACKUP_ONLY, WITH_SERVERS, False, id="reload-to-no-servers-is-meant"),
        pytest.param(False, WITH_SERVERS, WITH_SERVERS, False, id="has-servers"),
        pytest.param(False, BACKUP_ONLY, NO_BACKENDS, False, id="nothing-to-protect"),
        pytest.param(False, BACKUP_ONLY, None, False, id="no-config-in-place"),
    ],
)
def test_hold_back(replaces: bool, mine: Config, in_place: Config | None, held: bool):
    reason = hold_back_reason(replaces, mine, in_place)
    assert (reason is not None) == held
    if reason is not None:
        assert "\n" not in reason and "without -sf" in reason and "1 servers" in reason


# ---------------------------------------------------------------- the admin socket

SHOW_INFO = b"Name: HAProxy\nVersion: 2.6.12\nNbthread: 2\nProcess_num: 1\nPid: 4242\nUptime: 0d 0h00m01s\n\n"


def test_show_info_carries_the_bridges_pid():
    rewritten = with_pid(SHOW_INFO, 77)
    assert rewritten == SHOW_INFO.replace(b"Pid: 4242", b"Pid: 77")
    assert with_pid(b"Pid: 1\r\nUptime: 1\r\n", 5) == b"Pid: 5\r\nUptime: 1\r\n"
    assert with_pid(b"ProcessPid: 4242\n", 77) == b"ProcessPid: 4242\n"  # only the `Pid:` line


@pytest.mark.parametrize(
    ("line", "asks"),
    [
        (b"show info\n", True),
        (b"  show   info\n", True),
        (b"show stat;show info\n", True),
        (b"show servers state\n", False),
        (b"show information\n", False),
        (b"show stat\n", False),
    ],
)
def test_which_commands_are_show_info(line: bytes, asks: bool):
    assert asks_show_info(line) is asks


def test_socket_mode_and_hard_stop_after():
    assert socket_mode(("mode", "666", "level", "admin")) == 0o666
    assert socket_mode(("level", "admin")) == 0o600
    assert socket_mode(("mode", "rw")) == 0o600
    assert hard_stop_after_s(Config.parse("global\n    hard-stop-after 120s\n")) == 120
    assert hard_stop_after_s(Config.parse("global\n    hard-stop-after 2m\n")) == 120
    assert hard_stop_after_s(Config.parse("global\n    hard-stop-after 500\n")) == 0.5
    assert hard_stop_after_s(Config.parse("global\n    maxconn 1\n")) is None


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("    maxconn 10\n", "no `stats socket` in global"),
        ("    stats socket 127.0.0.1:9999 level admin\n", "is not a unix socket path"),
        ("    stats socket /run/hs/stats.sock mode 666\n", "the bridge would answer itself"),
    ],
)
def test_ray_configs_the_bridge_cannot_stand_in_for(line: str, error: str):
    settings = Settings(haproxy=HAProxySettings(runtime_dir=Path("/run/hs"), move_stats_socket=True))
    bridge = Bridge(settings, Run(Path(CFG)), asyncio.Event(), asyncio.Event())
    with pytest.raises(BridgeError, match=error):
        bridge.admin_socket(Config.parse(f"global\n{line}"))


def test_ray_admin_socket_and_its_mode():
    settings = Settings(haproxy=HAProxySettings(runtime_dir=Path("/run/hs"), move_stats_socket=True))
    bridge = Bridge(settings, Run(Path(CFG)), asyncio.Event(), asyncio.Event())
    config = Config.parse(f"global\n    stats socket unix@{SOCK} mode 666 level admin expose-fd listeners\n")
    assert bridge.admin_socket(config) == (Path(SOCK), 0o666)


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        (b"# pxname,svname,qcur\na,FRONTEND,0\na,s1,0\na,_hs_current,0\na,BACKEND,0\n",
         b"# pxname,svname,qcur\na,FRONTEND,0\na,s1,0\na,BACKEND,0\n"),
        (b"1\n# be_id be_name srv_id srv_name srv_addr\n3 a 1 s1 127.0.0.1 2\n3 a 2 _hs_current - 2\n",
         b"1\n# be_id be_name srv_id srv_name srv_addr\n3 a 1 s1 127.0.0.1 2\n"),
        (b"a,s1,0\r\na,_hs_current,0\r\n", b"a,s1,0\r\n"),
        (b"x,_hs_current_not,0\n", b"x,_hs_current_not,0\n"),  # another name
        (b"Name: HAProxy\n", b"Name: HAProxy\n"),
    ],
)
def test_the_hand_off_server_is_left_out_of_what_ray_reads(answer, kept):
    assert without_hand_off_rows(answer) == kept
