"""Controller-socket mode end to end, the master socket facade: a reload through it runs the
daemon's cycle, a refused config answers as HAProxy does with its alerts, and the facade and the
relay answer soon after a daemon restart."""

from __future__ import annotations

import asyncio
import errno
import json
import pwd
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from rigs.controller import disable, sync_line
from rigs.harness import KeepAliveClient, haproxy_binary
from rigs.sidecar import controller_accepts, reload_through_facade, roundtrip, sidecar
from supervisor.effective import build_effective
from supervisor.haproxy.answers import ProcList
from supervisor.settings import load_settings

pytestmark = pytest.mark.haproxy


# ---------------------------------------------------------------- the master socket facade


def pid_of(procs: ProcList) -> int:
    worker = procs.current_worker
    assert worker is not None, procs
    return worker.pid


async def test_reload_through_the_facade_runs_the_daemons_cycle(rundir):
    # The watcher would apply each write only after 10 s: what happens next is the facade's doing.
    async with sidecar(rundir, {"reload": {"runtime_apply": True, "debounce_ms": 10000, "max_delay_ms": 20000}}) as s:
        before = await s.daemon.show_proc()
        # A slot filled: servers only, so the cycle applies it at runtime, in the same worker.
        s.slots["SRV_3"] = s.pods[2]
        s.daemon.write(s.rendered())
        applied = await reload_through_facade(s)
        middle = await s.daemon.show_proc()
        states = await s.servers_state()
        # A line beyond servers: the cycle reloads.
        s.daemon.write(s.rendered().replace("    retries 1\n", "    retries 2\n"))
        reloaded = await reload_through_facade(s)
        after = await s.daemon.show_proc()
        # other commands on the line: answered by the master, in their place
        listed_then_reloaded = await roundtrip(s.master_socket, b"show proc;reload;quit\n", timeout=20)
        helped = await roundtrip(s.master_socket, b"set severity-output number;help;quit\n")
        info = await roundtrip(s.master_socket, b"@1 set severity-output number;@1 show info;quit\n")
        log = s.daemon.run_log()
    assert applied.startswith(b"Success=1\n--\n") and b"applied at runtime" in applied, f"{applied!r}\n{log}"
    assert pid_of(middle) == pid_of(before), "a change of servers only is no reload"
    assert states["SRV_3"] == (s.pods[2].address, "ready"), states
    assert reloaded.startswith(b"Success=1\n--\n") and b"reloaded" in reloaded, reloaded
    assert pid_of(after) != pid_of(before)
    assert b"[ALERT]" not in applied + reloaded
    assert listed_then_reloaded.startswith(b"#") and b"\nSuccess=1\n--\n" in listed_then_reloaded, listed_then_reloaded
    assert "controller master socket" in log
    assert b"help" in helped and b"show proc" in helped, helped[:300]  # the master's own list
    assert re.search(rb"\nVersion: \d+\.\d+", info), info[:200]


async def test_refused_config_answers_success_0_with_haproxys_alerts(rundir):
    async with sidecar(rundir) as s:
        before = await s.daemon.show_proc()
        s.daemon.write(s.rendered().replace("    balance roundrobin", "    balance roundrobin\n    bogus_keyword"))
        answer = await reload_through_facade(s)
        after = await s.daemon.show_proc()
        client = await KeepAliveClient(s.front).connect()
        try:
            status, _, _ = await client.get()
        finally:
            await client.close()
    assert answer.startswith(b"Success=0\n--\n"), answer
    assert re.search(rb"\[ALERT\].*bogus_keyword", answer), answer
    assert pid_of(after) == pid_of(before)
    assert status == 200  # the last good config serves


async def test_facade_and_relay_answer_within_a_second_of_a_daemon_restart(rundir):
    async with sidecar(rundir) as s:
        s.daemon.signal(signal.SIGQUIT)  # the daemon exits, HAProxy stays for the next one to adopt
        assert await s.daemon.wait_exit() == 3
        s.daemon.start()
        started = time.monotonic()
        deadline = started + 5
        while True:
            try:
                info = await roundtrip(s.master_socket, b"@1 set severity-output number;@1 show info;quit\n", 5)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline, "the facade did not come back"
                await asyncio.sleep(0.02)
        answered_s = time.monotonic() - started
        disabled = await roundtrip(s.runtime_socket, sync_line(disable("b", "SRV_1", port=1)))
        s.slots["SRV_1"] = None  # the controller writes its config as it runs it, then reloads
        s.daemon.write(s.rendered())
        answer = await reload_through_facade(s)
        states = await s.servers_state()
        log = s.daemon.run_log()
    # Bound before HAProxy is adopted; the time includes the interpreter's start on a shared host.
    assert log.index("controller master socket") < log.index("haproxy-supervisor starting"), log[-2000:]
    assert answered_s < 3.0, answered_s
    assert re.search(rb"\nVersion: \d+\.\d+", info), info[:200]
    assert controller_accepts(disabled), disabled
    assert answer.startswith(b"Success=1\n--\n"), answer
    assert states["SRV_1"] == ("127.0.0.1:1", "maint"), states


# ---------------------------------------------------------------- alerts as the controller reads them


def kic_faulty_lines(message: str) -> tuple[str, list[int]]:
    """kubernetes-ingress's reading of a failed reload (pkg/controller/controller.go keeps the
    lines starting `[ALERT]`, without that prefix; pkg/annotations/cfgSnippet.go,
    getErrorLineNumberAndFileName: the text between a line's first `[` and first `]`, split
    on `:` into exactly a file and a line number, the first file kept)."""
    file, numbers = "", []
    for line in message.split("\n"):
        if not line.startswith("[ALERT]"):
            continue
        line = line.removeprefix("[ALERT]")
        opening, closing = line.find("["), line.find("]")
        if opening == -1 or closing == -1:
            continue
        parts = line[opening + 1 : closing].split(":")
        assert len(parts) == 2, f"the controller gives up on {line!r}"
        file = file or parts[0]
        numbers.append(int(parts[1]))
    return file, numbers


async def status_document(s) -> dict:
    reader, writer = await asyncio.open_unix_connection(str(s.daemon.directory / "status.sock"))
    writer.write(b"GET /status HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n")
    answer = (await reader.read()).decode()
    writer.close()
    return json.loads(answer.partition("\r\n\r\n")[2])


async def test_a_refused_configs_alerts_name_the_rendered_file_and_line_as_haproxy_alone(rundir):
    """With the guard and observe injections moving lines, the controller's reading of the
    facade's answer finds the same file and line as of HAProxy run on the rendered config."""
    settings = {"old_workers": {"guard": True}, "observe": {"enabled": True}}
    async with sidecar(rundir, settings) as s:
        bad = s.rendered().replace("    balance roundrobin", "    balance roundrobin\n    bogus_keyword")
        s.daemon.write(bad)
        answer = (await reload_through_facade(s)).decode()
        document = await status_document(s)
        log = s.daemon.run_log()
        effective = build_effective(load_settings(s.daemon.settings_path), bad).text
        alone = subprocess.run([haproxy_binary(), "-c", "-f", str(s.daemon.rendered)],
                               capture_output=True, text=True, timeout=30)
    alone_file, alone_lines = kic_faulty_lines(alone.stdout + alone.stderr)
    assert alone.returncode != 0 and alone_file == str(s.daemon.rendered) and alone_lines, alone.stdout + alone.stderr
    assert bad.splitlines()[alone_lines[0] - 1].strip() == "bogus_keyword"
    # the effective config the daemon checks has that line elsewhere: HAProxy named another
    assert effective.splitlines().index("    bogus_keyword") + 1 != alone_lines[0]
    assert answer.startswith("Success=0\n--\n"), answer
    assert kic_faulty_lines(answer) == (alone_file, alone_lines), answer
    error = document["reloads"]["last"]["error"]
    assert kic_faulty_lines(error) == (alone_file, alone_lines), error
    assert f"[{alone_file}:{alone_lines[0]}]" in log, log[-2000:]
    assert "<effective config>" not in answer + error


# ---------------------------------------------------------------- no reload around the daemon

MASTER_VARIANTS = [
    b"reload;quit\n",
    b"@master reload;quit\n",
    b"@master\treload ; quit\n",
    b"show proc;reload;quit\n",
    b"RELOAD;quit\n",
    b"Reload\n",
    b"hard-reload;quit\n",
    b"@master hard-reload;quit\n",
    b"@1 reload\n",
    b"re\\load;quit\n",
    b"'reload';quit\n",
    b"show proc\\;reload\n",
    b"_send_status READY --pid 1 --version 1;quit\n",
    b"mcli-debug-mode on;reload\n",
    b"prompt\nshow proc\nreload\n",
    b"prompt\nhard-reload\n",
    b"help\n@master reload\n",
]


async def test_no_master_socket_line_reloads_haproxy_without_the_daemon(rundir):
    async with sidecar(rundir) as s:
        before = await s.daemon.show_proc()
        answers = [await roundtrip(s.master_socket, line, timeout=20) for line in MASTER_VARIANTS]
        await asyncio.sleep(1)  # a reload the master started would show by now
        after = await s.daemon.show_proc()
        reloads = s.daemon.count(r"reload (ok|skipped_unchanged|runtime_applied)")
        # the control: the same words straight to HAProxy's master socket reload it
        straight = await roundtrip(s.daemon.runtime / "master.sock", b"@master reload;quit\n", timeout=20)
        await asyncio.sleep(2)
        control = await s.daemon.show_proc()
    assert before.master is not None and after.master is not None and control.master is not None
    assert pid_of(after) == pid_of(before), (before, after)
    assert after.master.reloads == before.master.reloads, (before, after)  # `show proc`'s reload count
    assert reloads == s.daemon.count(r"reload skipped_unchanged"), "every reload the daemon's, all unchanged"
    for line, answer in zip(MASTER_VARIANTS, answers, strict=True):
        refused = re.search(rb"haproxy-supervisor: .* refused: the daemon owns HAProxy's reloads; send `reload`\n\Z",
                            answer)
        assert refused or b"Success=1\n--\n[NOTICE]" in answer, (line, answer)
        assert b"Reloading HAProxy" not in answer and b"New worker" not in answer, (line, answer)
    assert pid_of(control) != pid_of(after) and control.master.reloads > after.master.reloads, (straight, control)


# ---------------------------------------------------------------- two users


CLIENT = """\
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("refused", exc.errno)
    sys.exit(0)
s.sendall(sys.argv[2].encode() + b"\\n")
data = b""
while chunk := s.recv(65536):
    data += chunk
print("answered", data[:200])
"""


def client_as(uid: int, gid: int, path: Path, line: str) -> str:
    """A client as another user, the way the controller's container connects."""
    done = subprocess.run(["/usr/bin/python3", "-c", CLIENT, str(path), line], user=uid, group=gid, extra_groups=[],
                          capture_output=True, text=True, timeout=30, cwd="/")
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_only_the_controllers_user_gets_in(rundir):
    """The daemon (root here) makes both sockets the controller's user's (nobody), mode 0600:
    that user connects, any other user but root is refused."""
    nobody = pwd.getpwnam("nobody")
    rundir.chmod(0o711)  # the sockets' directory: the pod's shared emptyDir
    owner = {"controller": {"socket_owner": f"{nobody.pw_uid}:{nobody.pw_gid}", "socket_mode": "0600"}}
    async with sidecar(rundir, owner) as s:
        modes = {p: p.stat() for p in (s.runtime_socket, s.master_socket)}
        ids = nobody.pw_uid, nobody.pw_gid
        controller_runtime = client_as(*ids, s.runtime_socket, "set severity-output number;show info")
        controller_master = client_as(*ids, s.master_socket, "@1 show info;quit")
        other_runtime = client_as(12345, 12345, s.runtime_socket, "show info")
        other_master = client_as(12345, 12345, s.master_socket, "show proc")
    for st in modes.values():
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, nobody.pw_uid, nobody.pw_gid)
    assert controller_runtime.startswith("answered") and "Name: HAProxy" in controller_runtime, controller_runtime
    assert controller_master.startswith("answered") and "Name: HAProxy" in controller_master, controller_master
    assert other_runtime.strip() == other_master.strip() == f"refused {errno.EACCES}", (other_runtime, other_master)


async def test_control_the_default_sockets_keep_the_controllers_user_out(rundir):
    """What the pod ran into: root's sockets, 0660, and a controller running as another user."""
    nobody = pwd.getpwnam("nobody")
    rundir.chmod(0o711)
    async with sidecar(rundir) as s:
        answer = client_as(nobody.pw_uid, nobody.pw_gid, s.runtime_socket, "show info")
    assert answer.strip() == f"refused {errno.EACCES}", answer
