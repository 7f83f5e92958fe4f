"""Global keywords that conflict with being supervised: dropped with a log line, or refused with
one line. The e2e test runs the daemon on a rendered config written the way an ingress
controller ships it (`daemon`, `master-worker`, `pidfile`, a stats socket with `expose-fd
listeners`) and finds exactly one master, the daemon's child; the control starts HAProxy the
way the daemon does on the same config without the policy, and its master forks away."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from rigs.daemon import http_get
from rigs.harness import backends, free_port, kill_tree, wait_for
from supervisor.cli import main
from supervisor.effective import RenderedConfigError, build_effective
from supervisor.haproxy.config import Config
from supervisor.haproxy.global_policy import RefusedGlobal, supervised_global
from supervisor.master.process import master_command
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings

SOCKET = Path("/run/x/master.sock")

SHIPPED = """\
global
    daemon
    master-worker
    pidfile {pidfile}
    stats socket {stats} level admin expose-fd listeners
    hard-stop-after 30s

defaults
    mode http
    timeout connect 200ms
    timeout client 10s
    timeout server 10s

frontend fe
    bind 127.0.0.1:{front}
    default_backend app

backend app
    server s1 {backend}
"""


def test_daemon_and_pidfile_are_dropped_and_said_so():
    text = "global\n    daemon\n    maxconn 10\n    pidfile /var/run/haproxy.pid\nbackend b\n"
    out, notes = supervised_global(Config.parse(text), SOCKET)
    assert out.render() == "global\n    maxconn 10\nbackend b\n"
    assert len(notes) == 2
    assert notes[0].startswith("line 2: global `daemon` dropped from the effective config: ")
    assert notes[1].startswith("line 4: global `pidfile /var/run/haproxy.pid` dropped")


def test_master_worker_is_dropped_with_or_without_no_exit_on_failure_and_expose_fd_stays():
    # Plain `master-worker` says what -W says; 3.3+ warns it is deprecated at every check.
    text = (
        "global\n    master-worker\n    master-worker no-exit-on-failure\n"
        "    stats socket /run/ctl.sock level admin expose-fd listeners\n"
    )
    out, notes = supervised_global(Config.parse(text), SOCKET)
    assert out.render() == "global\n    stats socket /run/ctl.sock level admin expose-fd listeners\n"
    assert [n.split(":")[0] for n in notes] == ["line 2", "line 3"]
    assert "-W" in notes[0] and "crashed worker" in notes[1]


def test_a_config_without_those_keywords_is_the_same_object():
    config = Config.parse("global\n    maxconn 10\ndefaults\n    daemon_like yes\n")
    assert supervised_global(config, SOCKET) == (config, [])


def test_keywords_outside_global_are_not_touched():
    config = Config.parse("global\n    maxconn 1\nbackend b\n    # daemon\n    option daemon\n")
    assert supervised_global(config, SOCKET)[0].render() == config.render()


@pytest.mark.parametrize(
    ("line", "names"),
    [("nbproc 2", "global `nbproc` refused"), (f"stats socket {SOCKET} level admin", "master socket")],
)
def test_refused_in_one_line(line, names):
    with pytest.raises(RefusedGlobal) as caught:
        supervised_global(Config.parse(f"global\n    maxconn 1\n    {line}\n"), SOCKET)
    message = str(caught.value)
    assert message.startswith("line 3: ") and names in message and "\n" not in message


def test_build_logs_each_drop_and_refuses_with_the_file_named(tmp_path, caplog):
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path, config=tmp_path / "haproxy.cfg"))
    with caplog.at_level(logging.WARNING, logger="supervisor.effective"):
        effective = build_effective(settings, "global\n    daemon\n")
    assert "daemon" not in effective.text
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'haproxy.cfg'}: line 2: global `daemon` dropped from the effective config: "
        "the supervisor runs the HAProxy master in the foreground as its own child; with `daemon` "
        "the master would fork away and run unsupervised"
    ]
    with pytest.raises(RenderedConfigError, match=rf"^{tmp_path / 'haproxy.cfg'}: line 2: global `nbproc`"):
        build_effective(settings, "global\n    nbproc 2\n")


def test_check_refuses_nbproc_with_one_line(tmp_path, capsys):
    rendered = tmp_path / "haproxy.cfg"
    rendered.write_text("global\n    nbproc 4\n")
    settings = tmp_path / "settings.yaml"
    settings.write_text(f"haproxy:\n  config: {rendered}\n  runtime_dir: {tmp_path / 'run'}\n")
    assert main(["check", "--config", str(settings)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nbproc" in err and str(rendered) in err, err


# ---------------------------------------------------------------- against the binary


def masters_of(runtime: Path) -> list[psutil.Process]:
    """Every live HAProxy master started for this runtime_dir (its -S socket is there): the
    processes with that command line whose parent has another (workers are forked copies)."""
    socket = str(runtime / "master.sock")
    found: list[psutil.Process] = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or "-W" not in cmdline or "-S" not in cmdline:
            continue
        if cmdline[cmdline.index("-S") + 1].split(",")[0] == socket:
            found.append(proc)
    pids = {proc.pid for proc in found}
    return [proc for proc in found if proc.ppid() not in pids]


@pytest.mark.haproxy
async def test_run_with_daemon_in_the_rendered_config_leaves_one_master_the_daemons(make, rundir):
    front = free_port()
    with backends("s1", "s2") as b:
        rendered = SHIPPED.format(
            front=front, backend=b["s1"].address, pidfile=rundir / "ctl.pid", stats=rundir / "ctl.sock"
        )
        d = make(rendered)
        try:
            d.start()
            await d.wait_generation(1)
            await asyncio.sleep(1.5)  # a forked-away master would be restarted (and fork) by now
            masters = masters_of(d.runtime)
            assert [m.pid for m in masters] == [d.master_pid()], masters
            assert masters[0].ppid() == d.pid
            assert (await http_get(front))[0] == 200
            # The stats socket (expose-fd listeners) is kept, and reloads work with it.
            assert (rundir / "ctl.sock").is_socket()
            d.write(rendered.replace(b["s1"].address, b["s2"].address))
            await d.wait_generation(2)
            assert (await http_get(front))[2] == "s2"
            assert [m.pid for m in masters_of(d.runtime)] == [masters[0].pid]
            effective = Settings(haproxy=HAProxySettings(runtime_dir=d.runtime)).haproxy.effective_config.read_text()
            assert "    daemon\n" not in effective and "pidfile" not in effective and "expose-fd listeners" in effective
            assert d.count(r"line 2: global `daemon` dropped from the effective config") >= 2
            assert d.count(r"line 4: global `pidfile .*` dropped from the effective config") >= 2
            assert not (rundir / "ctl.pid").exists()
            d.signal(signal.SIGTERM)
            assert await d.wait_exit() == 0
            assert masters_of(d.runtime) == []
        finally:
            for master in masters_of(d.runtime):  # should there be any forked-away one
                kill_tree(master.pid)


@pytest.mark.haproxy
async def test_control_without_the_policy_the_master_forks_away(rundir):
    front = free_port()
    settings = Settings(haproxy=HAProxySettings(runtime_dir=rundir), old_workers=OldWorkerSettings(guard=False))
    with backends("s1") as b:
        text = SHIPPED.format(
            front=front, backend=b["s1"].address, pidfile=rundir / "ctl.pid", stats=rundir / "ctl.sock"
        )
        settings.haproxy.effective_config.write_text(text)  # the rendered text, no policy applied
        child = subprocess.Popen(master_command(settings), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        forked: list[psutil.Process] = []
        try:
            assert child.wait(10) == 0  # the process the daemon would own exits at once...
            forked = wait_for(lambda: masters_of(rundir), timeout=5, what="the forked master")
            # ...and the master it forked serves on, owned by nobody who started it.
            assert [m.pid for m in forked] != [child.pid] and all(m.ppid() != child.pid for m in forked)
            deadline = time.monotonic() + 5
            while (await http_get(front))[0] != 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert (await http_get(front))[0] == 200
        finally:
            for master in forked or masters_of(rundir):
                kill_tree(master.pid)
