"""Issue #24's incident, staged with real HAProxy: does a steered old worker route as HAProxy would?

One node dies and takes one server (`gone`) of every backend with it; the new rendered config
moves it (`moved`, at another address) and HAProxy reloads, while clients hold keep-alive
connections in the old worker. Each backend is one way HAProxy picks a server: cookie
persistence in every mode, stick tables, weights, map-based and consistent hashing, and the
stateful algorithms. Before the reload the clients learn where the (then current) worker sends
each key; after it, `measure` sends the same requests on the held connections and reports what
was kept. Who reloads is `supervised` (the daemon's reloader and steering, rigs/supervised.py)
with the guard on or off: off, it is HAProxy alone, reloaded by hand.

Everything listens on 127.0.0.1; every process is stopped by PID on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from rigs.harness import VanishedNode, backends, free_port, wait_for
from rigs.incident import Supervise
from rigs.supervised import supervised
from supervisor.haproxy import guard
from supervisor.haproxy.answers import parse_servers_state
from supervisor.haproxy.routing import PLAIN
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings
from supervisor.steering import dead, plan

LIVE = ("s1", "s2", "s3")
SLOW_S = 0.5

HEAD = """\
global
    hard-stop-after 120s
    close-spread-time infinite

defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    timeout http-keep-alive 30s
    retries 1
    option redispatch

frontend web
    bind 127.0.0.1:{front}
    option idle-close-on-response
    http-response set-header x-config {tag}
    use_backend %[path,field(2,/)]
"""

# name -> (kind, its lines, its servers: (name, extra words)); `gone` dies, `moved` replaces it.
BACKENDS: dict[str, tuple[str, list[str], list[tuple[str, str]]]] = {
    "ck_insert": ("cookie", ["cookie SRV insert indirect nocache"],
                  [("s1", "cookie s1"), ("s2", "cookie s2"), ("gone", "cookie gone")]),
    "ck_rewrite": ("cookie", ["cookie SRV rewrite"],
                   [("s1", "cookie r1"), ("s2", "cookie r2"), ("gone", "cookie rg")]),
    "ck_prefix": ("cookie", ["cookie JSESSIONID prefix"],
                  [("s1", "cookie p1"), ("s2", "cookie p2"), ("gone", "cookie pg")]),
    "ck_default": ("cookie", ["cookie SRV insert indirect", "default-server cookie dflt"],
                   [("s1", "cookie c1"), ("s2", ""), ("gone", "cookie cg")]),
    "stick_on": ("stick", ["stick-table type string len 32 size 10k", "stick on req.hdr(x-user)"],
                 [("s1", ""), ("s2", ""), ("gone", "")]),
    "stick_match": ("stick", ["stick-table type string len 32 size 10k", "stick match req.hdr(x-user)",
                              "stick store-request req.hdr(x-user)"],
                    [("s1", ""), ("s2", ""), ("gone", "")]),
    "weights": ("weights", ["balance roundrobin"], [("s1", "weight 10"), ("s2", "weight 90"), ("gone", "weight 50")]),
    "weight0": ("weights", ["balance roundrobin"],
                [("s1", "weight 1"), ("s2", "weight 0"), ("gone", "weight 1"), ("s3", "weight 1")]),
    # `down` listens nowhere: its checks fail before the reload, and the old worker keeps it DOWN.
    "weights_down": ("weights", ["balance roundrobin"],
                     [("s1", "weight 1"), ("s2", "weight 3"), ("gone", "weight 1"),
                      ("down", "weight 2 check inter 100ms")]),
    "hash_uri": ("hash", ["balance uri"], [("s1", ""), ("s2", ""), ("gone", ""), ("s3", "")]),
    "hash_hdr": ("hash", ["balance hdr(x-key)"], [("s1", ""), ("s2", "weight 2"), ("gone", ""), ("s3", "")]),
    "hash_param": ("hash", ["balance url_param k"], [("s1", ""), ("s2", ""), ("gone", ""), ("s3", "")]),
    "hash_uri_consistent": ("hash", ["balance uri", "hash-type consistent"],
                            [("s1", ""), ("s2", ""), ("gone", ""), ("s3", "")]),
    "leastconn": ("algorithm", ["balance leastconn"], [("s1", ""), ("s2", ""), ("gone", "")]),
    "roundrobin": ("algorithm", ["balance roundrobin"], [("s1", ""), ("s2", ""), ("gone", "")]),
    "first": ("algorithm", ["balance first"], [("s1", "maxconn 1"), ("s2", "maxconn 1"), ("gone", "maxconn 1")]),
    "random": ("algorithm", ["balance random"], [("s1", ""), ("s2", ""), ("gone", "")]),
}
# What a request of each kind varies, and how many distinct ones are sent.
KEYS = 48


def rendered(front: int, ports: dict[str, int], after: bool, tag: str) -> str:
    """The rendered config; `tag` names the run in every backend (nothing a cache of an
    earlier run knows), and the generation in a response header (so the change is a reload)."""
    text = HEAD.format(front=front, tag=f"{tag}-{'after' if after else 'before'}")
    for name, (_, lines, servers) in BACKENDS.items():
        text += f"\nbackend {name}\n    # run {tag}\n" + "".join(f"    {line}\n" for line in lines)
        for server, extra in servers:
            server = "moved" if after and server == "gone" else server
            text += f"    server {server} 127.0.0.1:{ports[server]} {extra}".rstrip() + "\n"
    return text


def cookie_of(backend: str, server: str) -> str | None:
    """The cookie header that names `server` in `backend` (a value HAProxy sets or accepts)."""
    lines = BACKENDS[backend][1]
    name = next(line.split()[1] for line in lines if line.startswith("cookie "))
    words = dict(BACKENDS[backend][2])[server].split()
    value = words[1] if "cookie" in words else next(
        (line.split()[2] for line in lines if line.startswith("default-server cookie")), None)
    if value is None:
        return None
    return f"{name}={value}~app" if "prefix" in lines[0] else f"{name}={value}"


class Client:
    """One HTTP/1.1 keep-alive connection; each request may carry its own headers."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.closed = False

    async def connect(self) -> Client:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def get(self, path: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> Answer:
        assert self.reader is not None and self.writer is not None
        started = time.monotonic()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        try:
            self.writer.write(f"GET {path} HTTP/1.1\r\nhost: test\r\n{extra}\r\n".encode())
            await self.writer.drain()
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
            fields = [line.partition(b":") for line in head.split(b"\r\n")[1:]]
            values = {k.strip().lower().decode(): v.strip().decode() for k, _, v in fields}
            length = int(values.get("content-length", "0"))
            body = await asyncio.wait_for(self.reader.readexactly(length), timeout) if length else b""
            status = int(head.split(b" ", 2)[1])
            return Answer(status, body.decode().strip(), values.get("set-cookie", ""), time.monotonic() - started)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return Answer(0, "", "", time.monotonic() - started)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()


@dataclass(frozen=True)
class Answer:
    status: int
    server: str
    set_cookie: str
    seconds: float

    @property
    def bad(self) -> bool:
        return self.status != 200 or self.seconds >= SLOW_S


@dataclass
class Figures:
    """One backend's requests in the steered old worker."""

    backend: str
    kind: str
    kept: int = 0  # requests whose server (by cookie, stick entry or hash key) lives and was kept
    keepable: int = 0  # requests whose server lives
    moved_ok: int = 0  # requests whose server is dead that reached a live server
    movable: int = 0
    shares: Counter[str] = field(default_factory=Counter)  # server -> requests, for the spread
    expected: dict[str, float] = field(default_factory=dict)  # server -> HAProxy's own share
    bad: int = 0  # failed, or slower than SLOW_S
    total: int = 0

    @property
    def kept_pct(self) -> float:
        return 100.0 * self.kept / self.keepable if self.keepable else 100.0

    def share_pct(self, server: str) -> float:
        spread = sum(self.shares.values())
        return 100.0 * self.shares[server] / spread if spread else 0.0

    def share_gap(self, server: str) -> float:
        """Points between the server's measured share and HAProxy's own."""
        return abs(self.share_pct(server) - 100 * self.expected.get(server, 0.0))

    @property
    def worst_share_gap(self) -> float:
        return max((self.share_gap(s) for s in self.expected), default=0.0)


@dataclass
class Stage:
    sup: Any  # a Supervised, DaemonSupervised or PlainHAProxy
    held: dict[str, list[Client]]  # backend -> connections the old worker holds
    learned: dict[str, dict[str, str]]  # backend -> request key -> server before the reload
    old_pid: int

    async def measure(self, backend: str, requests: int = 200) -> Figures:
        kind = BACKENDS[backend][0]
        figures = Figures(backend, kind)
        clients = self.held[backend]

        async def send(i: int, path: str, headers: dict[str, str] | None = None) -> Answer:
            # A request that fails may close its connection (HAProxy alone): the next ones go
            # on the other held connections, and fail too once none is left.
            open_ones = [c for c in clients if not c.closed]
            if open_ones:
                client = open_ones[i % len(open_ones)]
                answer = await client.get(path, headers)
                client.closed = answer.status == 0
            else:
                answer = Answer(0, "", "", 0.0)
            figures.total += 1
            figures.bad += answer.bad
            return answer

        if kind == "cookie":
            for i in range(requests):
                server = ("s1", "s2", "gone")[i % 3]
                answer = await send(i, f"/{backend}/x", {"cookie": cookie_of(backend, server) or ""})
                if server == "gone":
                    figures.movable += 1
                    figures.moved_ok += answer.server in LIVE
                elif answer.status == 200:  # a request not answered is counted bad, not moved
                    figures.keepable += 1
                    figures.kept += answer.server == server
        elif kind == "stick":
            # An old worker empties its stick tables at soft-stop (seen on 2.6.12, 2.8.25 and
            # 3.0.11, without peers): a key's first request in it stores a server anew, and the
            # next ones must stay there.
            keys = [f"k{i:02d}" for i in range(KEYS)]
            first = {key: await send(i, *_keyed(backend, key)) for i, key in enumerate(keys)}
            figures.movable, figures.moved_ok = len(keys), sum(a.server in LIVE for a in first.values())
            for i, key in enumerate(keys * 2):
                answer = await send(i, *_keyed(backend, key))
                kept = first[key].server in LIVE and answer.status == 200
                figures.keepable += kept
                figures.kept += kept and answer.server == first[key].server
        elif kind == "hash":
            for i, (key, server) in enumerate(sorted(self.learned[backend].items()) * 3):
                answer = await send(i, *_keyed(backend, key))
                if server == "gone":
                    figures.movable += 1
                    figures.moved_ok += answer.server in LIVE
                elif answer.status == 200:  # a request not answered is counted bad, not moved
                    figures.keepable += 1
                    figures.kept += answer.server == server
        else:
            for i in range(requests):
                answer = await send(i, f"/{backend}/x")
                figures.shares[answer.server] += 1
            weights = {s: _weight(extra) for s, extra in BACKENDS[backend][2] if s not in ("gone", "down")}
            if kind == "weights":
                total = sum(weights.values())
                figures.expected = {s: w / total for s, w in weights.items()}
        return figures


def _weight(extra: str) -> int:
    words = extra.split()
    return int(words[words.index("weight") + 1]) if "weight" in words else 1


def _keyed(backend: str, key: str) -> tuple[str, dict[str, str]]:
    """The path and headers of the request that carries `key` for the backend's kind."""
    if backend.startswith("stick"):
        return f"/{backend}/x", {"x-user": key}
    if backend == "hash_hdr":
        return f"/{backend}/x", {"x-key": key}
    if backend == "hash_param":
        return f"/{backend}/x?k={key}", {}
    return f"/{backend}/{key}", {}


def settings_for(rundir, guard: bool) -> Settings:
    return Settings(
        haproxy=HAProxySettings(runtime_dir=rundir),
        old_workers=OldWorkerSettings(guard=guard, poll_interval_ms=100),
    )


@contextlib.contextmanager
def fidelity_disabled(monkeypatch) -> Iterator[None]:
    """Today's override, for the controls: the guard reproduces nothing of HAProxy's choice
    (no cookie, stick or hash rules, no weighted draws): every steered request is drawn."""
    with monkeypatch.context() as patch:
        patch.setattr(guard, "routing_of", lambda *_: PLAIN)
        patch.setattr(dead, "routing_of", lambda *_: PLAIN)
        patch.setattr(plan, "weighted_draws", lambda *_: [])
        yield


@contextlib.asynccontextmanager
async def staged(
    rundir, guard: bool, connections: int = 2, tag: str = "", supervise: Supervise = supervised
) -> AsyncIterator[Stage]:
    """The old worker after the reload, `gone` vanished, steered when `guard` is on.
    `supervise`: the supervisor's component in this process (the default), the real daemon
    or plain HAProxy (rigs/incident.py's daemon_supervised and plain_haproxy)."""
    front = free_port()
    tag = tag or f"t{time.monotonic_ns()}"
    with backends(*LIVE, "gone", "moved") as started:
        ports = {name: b.port for name, b in started.items()} | {"down": free_port()}
        held: dict[str, list[Client]] = {}
        vanished: VanishedNode | None = None
        async with supervise(settings_for(rundir, guard), rendered(front, ports, False, tag)) as sup:
            try:
                learned: dict[str, dict[str, str]] = {}
                for backend, (kind, _, _) in BACKENDS.items():
                    held[backend] = [await Client(front).connect() for _ in range(connections)]
                    if kind == "hash":
                        keys = [f"k{i:02d}" for i in range(KEYS)]
                        answers = [await held[backend][0].get(*_keyed(backend, k)) for k in keys]
                        if any(a.status != 200 for a in answers):
                            raise RuntimeError(f"{backend} before the reload: {answers}")
                        learned[backend] = {k: a.server for k, a in zip(keys, answers, strict=True)}
                    else:
                        for client in held[backend]:
                            await client.get(f"/{backend}/x")
                old_pid = sup.current_pid

                def down_seen() -> bool:
                    answer = sup.master.command(f"@!{old_pid} show servers state weights_down")
                    states = parse_servers_state(answer)
                    return any(st.name == "down" and (st.op_state == 0 or st.in_maint) for st in states)

                wait_for(down_seen, timeout=10, what="server `down` DOWN")
                await sup.reload(rendered(front, ports, True, tag))
                started["gone"].stop()
                vanished = VanishedNode(ports["gone"])
                if guard:
                    await sup.wait_steered([old_pid], timeout=15.0)
                yield Stage(sup, held, learned, old_pid)
            finally:
                for clients in held.values():
                    for client in clients:
                        await client.close()
                if vanished is not None:
                    vanished.close()
