"""Capture what a real HAProxy answers to every command the runtime path sends, alone and on
`;` lines, into tests/captured/answers_<version>.txt; the table tests parse those files.

    HAPROXY_BIN=/path/to/haproxy .venv/bin/python -m tests.support.capture_answers

Each case is a command line sent to the master CLI (`@!<pid>` prefixes filled in) and the
exact answer, bytes escaped as Python writes them. The worker's servers are set up by the
cases themselves, so the file reads top to bottom as one session.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rigs.harness import free_port
from supervisor.haproxy.answers import parse_show_proc
from supervisor.haproxy.api import MasterCLI

CAPTURED = Path(__file__).resolve().parent.parent / "captured"

CONFIG = """\
global
    stats timeout 10s
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend fe
    bind 127.0.0.1:{fe_port}
    default_backend b
backend b
    balance roundrobin
    http-request set-var(txn.key) str(b_0)
    use-server %[var(txn.key),map({slots})] if {{ var(txn.key),map({slots}) -m found }}
    server s1 127.0.0.1:{port}
    server s2 127.0.0.1:{port}
    server s3 127.0.0.1:{port}
    server s4 127.0.0.1:{port}
    server s5 127.0.0.1:{port}
    server s6 127.0.0.1:{port}
    server held 127.0.0.1:{held_port}
"""

ADD = "add server b/{name} 127.0.0.1:{port} check inter 1s agent-check agent-port {port} agent-inter 1s"

# (label, commands). `@` before a command routes it to the current worker.
CASES: list[tuple[str, list[str]]] = [
    ("experimental-mode on, then add server", ["experimental-mode on", "@" + ADD.format(name="n0", port="{port}")]),
    ("add server", ["@" + ADD.format(name="n1", port="{port}")]),
    ("add server x2", ["@" + ADD.format(name="n2", port="{port}"), "@" + ADD.format(name="n3", port="{port}")]),
    ("add server, already there", ["@" + ADD.format(name="n1", port="{port}")]),
    ("add server, no such backend", ["@add server nob/x 127.0.0.1:1"]),
    ("enable health x2", ["@enable health b/n2", "@enable health b/n3"]),
    ("enable health, no such server", ["@enable health b/nosuch"]),
    ("enable health, no check configured", ["@enable health b/s1"]),
    ("enable agent x2", ["@enable agent b/n2", "@enable agent b/n3"]),
    ("enable agent, no agent configured", ["@enable agent b/s1"]),
    ("set server state ready x2", ["@set server b/n2 state ready", "@set server b/n3 state ready"]),
    ("set server state maint x3", ["@set server b/s1 state maint", "@set server b/s2 state maint",
                                   "@set server b/s3 state maint"]),
    ("set server state, no such server", ["@set server b/nosuch state maint"]),
    ("set server state, no such backend", ["@set server nob/s1 state maint"]),
    ("set server weight x2", ["@set server b/s4 weight 3", "@set server b/s5 weight 4"]),
    ("set server weight, out of range", ["@set server b/s4 weight 300"]),
    ("set server addr port", ["@set server b/s1 addr 127.0.0.1 port 1"]),
    ("set server addr, nothing changes", ["@set server b/s1 addr 127.0.0.1 port 1"]),
    ("set server addr x2", ["@set server b/s2 addr 127.0.0.2 port 1", "@set server b/s3 addr 127.0.0.1 port 1"]),
    ("set server addr, invalid", ["@set server b/s2 addr foo.example port 1"]),
    ("shutdown sessions server x2", ["@shutdown sessions server b/s1", "@shutdown sessions server b/s2"]),
    ("shutdown sessions server, no such server", ["@shutdown sessions server b/nosuch"]),
    ("del server, not in maint", ["@del server b/s4"]),
    ("del server", ["@del server b/s1"]),
    ("del server x2", ["@del server b/s2", "@del server b/s3"]),
    ("del server, already deleted", ["@del server b/s1"]),
    ("del server, deleted and gone", ["@del server b/s1", "@del server b/s2"]),
    ("set server state maint, held connection", ["@set server b/held state maint"]),
    ("del server, connection attached", ["@del server b/held"]),
    ("del server x2, one attached", ["@set server b/s5 state maint", "@del server b/s5", "@del server b/held"]),
    ("del server, no such backend", ["@del server nob/s1"]),
    ("set server addr, placeholder", ["@set server b/held addr 127.0.0.1 port 1"]),
    ("show servers state", ["@show servers state"]),
    ("show servers state b", ["@show servers state b"]),
    ("show servers state, no such backend", ["@show servers state nob"]),
    ("show map", ["@show map"]),
    ("show map file", ["@show map {slots}"]),
    ("add map x2", ["@add map {slots} b_0 s6", "@add map {slots} b_1 s6"]),
    ("set map x2", ["@set map {slots} b_0 n2", "@set map {slots} b_1 n3"]),
    ("set map, no such key", ["@set map {slots} nokey n2"]),
    ("show map file, after", ["@show map {slots}"]),
    ("del map x2", ["@del map {slots} b_0", "@del map {slots} b_1"]),
    ("del map, no such key", ["@del map {slots} b_0"]),
    ("mixed: state maint, del server, addr", ["@set server b/n3 state maint", "@del server b/n3",
                                             "@set server b/n2 addr 127.0.0.1 port 2"]),
    ("unknown pid", ["@!999999 show info"]),
]


def version_of(binary: str) -> str:
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"version (\d+\.\d+\.\d+)", out)
    assert m, out
    return m.group(1)


async def capture(binary: str, workdir: Path) -> str:
    backend = socket.socket()
    backend.bind(("127.0.0.1", 0))
    backend.listen(16)
    port = backend.getsockname()[1]
    held_backend = socket.socket()
    held_backend.bind(("127.0.0.1", 0))
    held_backend.listen(16)
    held_port = held_backend.getsockname()[1]
    fe_port = free_port()
    slots = workdir / "slots.map"
    slots.write_text("")
    cfg = workdir / "haproxy.cfg"
    cfg.write_text(CONFIG.format(fe_port=fe_port, port=port, held_port=held_port, slots=slots))
    sock = workdir / "master.sock"
    proc = subprocess.Popen(
        [binary, "-W", "-S", str(sock), "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    cli = MasterCLI(sock)
    client: socket.socket | None = None
    try:
        worker = None
        for _ in range(100):
            if sock.exists():
                try:
                    worker = parse_show_proc(await cli.execute("show proc")).current_worker
                except Exception:
                    worker = None
                if worker is not None:
                    break
            time.sleep(0.05)
        assert worker is not None, "no worker"
        # A client whose request is held by the `held` server: the connection stays attached.
        # From 3.1 on `show proc` lists the worker before it binds its ports: wait for them.
        for _ in range(100):
            try:
                client = socket.create_connection(("127.0.0.1", fe_port))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        assert client is not None, "the worker never listened"
        for server in ("s1", "s2", "s3", "s4", "s5", "s6"):
            await cli.on(worker.pid, f"set server b/{server} state maint")
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        accepted, _ = held_backend.accept()  # held open, never answered
        for server in ("s1", "s2", "s3", "s4", "s5", "s6"):
            await cli.on(worker.pid, f"set server b/{server} state ready")
        out = [f"# HAProxy {version_of(binary)}: master CLI answers, captured by tests/support/capture_answers.py",
               "# case: <label>", "# line: <the command line sent>", "# answer: <repr of the answer>", ""]
        for label, commands in CASES:
            line = ";".join(
                (f"@!{worker.pid} {c[1:]}" if c.startswith("@") and not c.startswith("@!") else c)
                .replace("{port}", str(port)).replace("{slots}", str(slots))
                for c in commands
            )
            answer = await cli.execute(line)
            names = [(str(slots), "<slots>"), (str(workdir), "<dir>"), (str(worker.pid), "<pid>"),
                     (str(port), "<port>"), (str(held_port), "<port>")]
            shown, shown_answer = line, answer
            for value, name in names:
                shown, shown_answer = shown.replace(value, name), shown_answer.replace(value, name)
            out += [f"case: {label}", f"line: {shown}", f"answer: {shown_answer!r}", ""]
        accepted.close()
        return "\n".join(out)
    finally:
        if client is not None:
            client.close()
        proc.terminate()
        proc.wait(10)
        backend.close()
        held_backend.close()


def main() -> None:
    binary = os.environ.get("HAPROXY_BIN", "/usr/sbin/haproxy")
    version = version_of(binary)
    with tempfile.TemporaryDirectory() as tmp:
        text = asyncio.run(capture(binary, Path(tmp)))
    target = CAPTURED / f"answers_{version}.txt"
    target.write_text(text)
    print(f"{target}: {len(CASES)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
