"""What bench/ray_drain.py records beside its answers, to explain the slow and failed requests.

- HAProxy's own log of each request: Ray's template logs `option httplog` lines to
  RAY_SERVE_HAPROXY_LOG_TARGET, which the bench points at a unix datagram socket it reads (no
  network). A line names the server, the retries (`%rc`, `+` when redispatched), Tc and Tr, and
  the termination state; its pid tells the old worker from the current one.
- Socket probes: `ss -tnpioO` every second during the incident (no shell), kept for the HAProxy
  sockets toward the vanished node's ports: the state (SYN-SENT, ESTAB), Send-Q, retransmissions.
- The HAProxy processes of the head node, seen every 100 ms: how many each Ray operation started.
- Each distinct config Ray renders on the head, as a diff from the one before.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench.drain import SLOW_S, Answer

# option httplog: %ci:%cp [%tr] %ft %b/%s %TR/%Tw/%Tc/%Tr/%Ta %ST %B %CC %CS %tsc
#   %ac/%fc/%bc/%sc/%rc %sq/%bq %hr %hs %{+Q}r
HTTPLOG = re.compile(
    r"haproxy\[(?P<pid>\d+)\]: (?P<client>\S+) \[(?P<accepted>[^\]]+)\] (?P<frontend>\S+) "
    r"(?P<backend>[^/\s]+)/(?P<server>\S+) (?P<TR>-?\d+)/(?P<Tw>-?\d+)/(?P<Tc>-?\d+)/(?P<Tr>-?\d+)/(?P<Ta>\+?-?\d+) "
    r"(?P<status>-?\d+) \+?\d+ \S+ \S+ (?P<termination>\S{4}) \d+/\d+/\d+/\d+/(?P<retries>\+?\d+) \d+/\d+ "
    r'.*"(?P<request>[^"]*)"'
)


def parse_httplog(line: str) -> dict[str, Any] | None:
    """One `option httplog` line as a dict of the fields the report needs; None for other lines."""
    found = HTTPLOG.search(line)
    if found is None:
        return None
    fields: dict[str, Any] = found.groupdict()
    for name in ("pid", "TR", "Tw", "Tc", "Tr", "status"):
        fields[name] = int(fields[name])
    fields["Ta"] = int(fields["Ta"].lstrip("+"))
    fields["redispatched"] = fields["retries"].startswith("+")
    fields["retries"] = int(fields["retries"].lstrip("+"))
    return fields


def peer_port(ss_line: str) -> int | None:
    """The peer's port of one `ss -tnO` line (state, Recv-Q, Send-Q, local, peer, ...)."""
    fields = ss_line.split()
    if len(fields) < 5:
        return None
    _, _, port = fields[4].rpartition(":")
    return int(port) if port.isdigit() else None


SS_KEPT = ("pid=", "timer:", "retrans:", "rto:", "unacked:", "lastsnd:")


def short_ss(ss_line: str) -> str:
    """State, Send-Q, the two ends, then only the pid, timer, retransmissions, RTO and unacked."""
    fields = ss_line.split()
    pid = next((f.split("pid=")[1].split(",")[0] for f in fields if "pid=" in f), "?")
    kept = [f for f in fields[5:] if f.startswith(SS_KEPT[1:])]
    return " ".join([fields[0], f"Send-Q {fields[2]}", fields[3], "->", fields[4], f"pid {pid}", *kept])


def roomy_log_queue() -> None:
    """Inside the bench's own network namespace: a unix datagram socket queues 10 lines by
    default (net.unix.max_dgram_qlen, per namespace), and HAProxy drops the lines that do not fit."""
    Path("/proc/sys/net/unix/max_dgram_qlen").write_text("4096")


class _Loop(threading.Thread):
    """Calls `step` every `interval` seconds until stopped."""

    def __init__(self, step: Callable[[], None], interval: float) -> None:
        super().__init__(daemon=True)
        self.step, self.interval, self.stopping = step, interval, threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(Exception):
                self.step()
            self.stopping.wait(self.interval)

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)


class Evidence:
    """The recorders of one run; times are seconds on time.monotonic()."""

    def __init__(self, log_socket: Path, rendered: Callable[[], Path | None],
                 head_haproxy: Callable[[psutil.Process], bool]) -> None:
        self.log_socket = log_socket
        self.log_lines: list[tuple[float, str]] = []
        self.probes: list[tuple[float, list[str]]] = []
        self.renders: list[tuple[float, str]] = []
        self.haproxy_seen: dict[int, float] = {}
        self._rendered, self._head_haproxy = rendered, head_haproxy
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(log_socket))
        self._sock.settimeout(0.2)
        self._loops = [_Loop(self._read_log, 0), _Loop(self._watch, 0.1)]
        self._probe: _Loop | None = None

    def start(self) -> Evidence:
        for loop in self._loops:
            loop.start()
        return self

    def start_probes(self) -> None:
        self._probe = _Loop(self._ss, 1.0)
        self._probe.start()

    def stop(self) -> None:
        for loop in [*self._loops, *([self._probe] if self._probe else [])]:
            loop.stop()
        self._sock.close()

    def _read_log(self) -> None:
        with contextlib.suppress(TimeoutError):
            data = self._sock.recv(65536)
            self.log_lines.append((time.monotonic(), data.decode(errors="replace")))

    def _ss(self) -> None:
        found = subprocess.run(["ss", "-tnpioO"], capture_output=True, text=True, timeout=5, check=False).stdout
        self.probes.append((time.monotonic(), [line for line in found.splitlines() if '"haproxy"' in line]))

    def _watch(self) -> None:
        now = time.monotonic()
        for proc in psutil.process_iter(["name", "cmdline"]):
            if proc.info["name"] == "haproxy" and proc.pid not in self.haproxy_seen and self._head_haproxy(proc):
                self.haproxy_seen[proc.pid] = now
        path = self._rendered()
        if path is not None:
            with contextlib.suppress(OSError):
                text = path.read_text()
                if text and (not self.renders or self.renders[-1][1] != text):
                    self.renders.append((now, text))

    def started_between(self, start: float, end: float) -> int:
        """Head HAProxy processes that appeared in [start, end)."""
        return sum(start <= seen < end for seen in self.haproxy_seen.values())

    def report(self, since: float, dropped: set[int]) -> dict[str, Any]:
        """The requests HAProxy logged, probes toward the dropped ports, and the renders' diffs."""
        requests = []
        for at, line in self.log_lines:
            fields = parse_httplog(line)
            if fields is not None:
                requests.append({"at": round(at - since, 3), **fields})
            elif "Health check" in line or "is DOWN" in line or "is UP" in line:
                requests.append({"at": round(at - since, 3), "event": line.split(": ", 1)[-1].strip()})
        probes = [
            {"at": round(at - since, 3), "sockets": kept}
            for at, lines in self.probes
            if at >= since - 1 and (kept := [line for line in lines if peer_port(line) in dropped])
        ]
        renders = []
        for (_, before), (at, after) in zip(self.renders, self.renders[1:], strict=False):
            diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            renders.append({"at": round(at - since, 3),
                            "diff": [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]})
        return {"log": requests, "probes": probes, "renders": renders}


def explained(answers: list[Answer], sent_at: list[float], evidence: dict[str, Any]) -> list[str]:
    """Each slow or failed request with what HAProxy logged for it, then the socket probes and
    the health events."""
    logged: dict[str, list[dict[str, Any]]] = {}
    for entry in evidence.get("log", []):
        request = entry.get("request", "")
        if "?r=" in request:
            logged.setdefault(request.split("?r=")[1].split()[0], []).append(entry)
    lines = []
    for i, answer in enumerate(answers):
        if answer.status == 200 and answer.seconds <= SLOW_S:
            continue
        sent = sent_at[i] if i < len(sent_at) else 0.0
        lines.append(f"r={i} {answer.app} sent +{sent:.2f} s: {answer.status} in {answer.seconds:.2f} s")
        for e in logged.get(str(i), []):
            lines.append(f"  haproxy[{e['pid']}] {e['backend']}/{e['server']} retries {e['retries']}"
                         f"{' redispatched' if e['redispatched'] else ''} Tc {e['Tc']} Tr {e['Tr']} Ta {e['Ta']}"
                         f" status {e['status']} {e['termination']} (logged +{e['at']:.2f} s)")
    for probe in evidence.get("probes", []):
        for sock in probe["sockets"]:
            lines.append(f"ss +{probe['at']:.1f} s: {short_ss(sock)}")
    for entry in evidence.get("log", []):
        if "event" in entry and entry["at"] >= -1:  # from the vanish on
            lines.append(f"log +{entry['at']:.2f} s: {entry['event']}")
    return lines
