"""A State that looks like a daemon that has been running for an hour, and a recording `actions`.

Three generations from the corpus: generation 1 (handwritten_basic.cfg) and 2
(rayserve.cfg) still run in old workers, generation 3 (rayserve.cfg) in the current
worker. Times are relative to `now`, so unit tests can pin the clock.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from supervisor.haproxy.config import Config
from supervisor.state import (
    Generation,
    OldWorker,
    PendingRemoval,
    PushState,
    ReloadRecord,
    ReloadResult,
    State,
    SuspectServer,
    utcnow,
)
from tests.conftest import CORPUS

MASTER_PID = 41000
CURRENT_PID = 41203
OLD_PIDS = (41101, 41102)  # oldest first
# A reload error as `haproxy -c` prints it: config text an operator wrote, markup included.
HOSTILE_ERROR = "[ALERT] parsing [haproxy.cfg:12]: unknown keyword '<script>alert(1)</script>' in 'backend'"


def _generation(number: int, corpus_file: str, started_at: datetime, worker_pid: int) -> Generation:
    return _generation_of((CORPUS / corpus_file).read_text(), number, started_at, worker_pid)


def _generation_of(text: str, number: int, started_at: datetime, worker_pid: int) -> Generation:
    sha = hashlib.sha256(text.encode()).hexdigest()
    return Generation(number, Config.parse(text), sha, sha, started_at, worker_pid)


def running_state(now: datetime | None = None) -> State:
    now = now or utcnow()
    state = State(
        started_at=now - timedelta(hours=1, minutes=2, seconds=3),
        haproxy_binary="/usr/sbin/haproxy",
        haproxy_version="2.6.12-1+deb12u1",
        master_pid=MASTER_PID,
        master_restarts=1,
        master_up=True,
    )
    state.generations = {
        1: _generation(1, "handwritten_basic.cfg", now - timedelta(minutes=40), OLD_PIDS[0]),
        2: _generation(2, "rayserve.cfg", now - timedelta(minutes=3), OLD_PIDS[1]),
        3: _generation(3, "rayserve.cfg", now - timedelta(seconds=20), CURRENT_PID),
    }
    state.current_generation = 3
    state.rendered_sha256 = state.last_good_sha256 = state.generations[3].effective_sha256
    state.old_workers = {
        OLD_PIDS[1]: OldWorker(
            OLD_PIDS[1], 2, now - timedelta(minutes=3), rss_bytes=41 * 1024 * 1024, connections=3,
            steered=["highscale/highscale_r2", "echo/echo_r1"],
            push=PushState("failed", now - timedelta(seconds=2), "master CLI /run/x/master.sock: timed out"),
        ),
        OLD_PIDS[0]: OldWorker(
            OLD_PIDS[0], 1, now - timedelta(minutes=40), rss_bytes=48 * 1024 * 1024, connections=12,
            steered=["app/app1"], push=PushState("ok", now - timedelta(seconds=5)),
        ),
    }
    history: list[tuple[ReloadResult, float, str | None, timedelta]] = [
        ("ok", 180.0, None, timedelta(minutes=40)),
        ("invalid", 35.5, HOSTILE_ERROR, timedelta(minutes=10)),
        ("ok", 210.25, None, timedelta(minutes=3)),
        ("runtime_applied", 4.0, None, timedelta(minutes=2)),
        ("skipped_unchanged", 1.0, None, timedelta(minutes=1)),
        ("failed", 30000.0, "no new worker in show proc within 30s", timedelta(seconds=40)),
        ("ok", 190.0, None, timedelta(seconds=20)),
    ]
    for result, duration_ms, error, ago in history:
        record = state.reloads.record(result, duration_ms, error)
        record.at = now - ago
    state.dead_servers = {"app/app1", "echo/echo_r1", "highscale/highscale_r2"}
    state.operator_dead = {"highscale/highscale_r2"}
    state.publish_write("generations index", "/run/haproxy-supervisor/generations.json: No space left on device")
    state.publish_pending_removals({"echo/echo_r0": PendingRemoval(
        "echo/echo_r0", 4242, now - timedelta(seconds=4), 0.0, tries=6,
        last_answer="Server still has connections attached to it, cannot remove it.",
    )})
    state.publish_suspects({"echo/echo_r1": SuspectServer(
        "echo/echo_r1", "10.0.0.11:8000", "connect", now - timedelta(seconds=2),
    )})
    state.publish_socket_aborts(3, 1)
    state.push_failures = 2
    pushes = (0.003, 0.02, 0.02, 0.2, 3.0)
    for seconds in pushes:
        state.push_duration.observe(seconds)
    state.push_duration.recent.clear()  # observe() notes the wall clock; these times follow `now`
    state.push_duration.recent.extend((now - timedelta(minutes=len(pushes) - i), s) for i, s in enumerate(pushes))
    return state


class RecordingActions:
    """The daemon's side of the operator API, as far as status needs it: it records every call."""

    def __init__(self, state: State, reload_result: ReloadResult | None = "ok", error: str | None = None) -> None:
        self.state = state
        self.reload_result = reload_result  # None: behave like a daemon that only queues the reload
        self.error = error
        self.calls: list[tuple[str, ...]] = []

    async def reload_now(self) -> ReloadRecord | None:
        self.calls.append(("reload_now",))
        if self.reload_result is None:
            return None
        return self.state.reloads.record(self.reload_result, 12.5, self.error)

    async def mark_dead(self, backend: str, server: str) -> None:
        self.calls.append(("mark_dead", backend, server))
        self.state.operator_dead.add(f"{backend}/{server}")
        self.state.dead_servers.add(f"{backend}/{server}")

    async def unmark_dead(self, backend: str, server: str) -> None:
        self.calls.append(("unmark_dead", backend, server))
        self.state.operator_dead.discard(f"{backend}/{server}")
        self.state.dead_servers.discard(f"{backend}/{server}")

    def has_server(self, backend: str, server: str) -> bool:
        running = {self.state.current_generation} | {w.generation for w in self.state.old_workers.values()}
        return any(
            f"{backend}/{server}" in self.state.generations[n].model.server_map()
            for n in running
            if n in self.state.generations
        )


# ---------------------------------------------------------------- a fleet-sized drain

FLEET_BACKENDS = 1000
FLEET_PER_BACKEND = 10


def fleet_config(backends: int = FLEET_BACKENDS, per_backend: int = FLEET_PER_BACKEND) -> str:
    """A Ray Serve-shaped config: `backends` backends of `per_backend` servers (10,000 by default)."""
    parts = ["global\n    maxconn 1000\n\ndefaults\n    mode http\n    timeout connect 1s\n"
             "    timeout client 30s\n    timeout server 30s\n\nfrontend fe\n    bind 127.0.0.1:18080\n"
             "    default_backend b0\n"]
    for b in range(backends):
        address = f"10.0.{b // 250}.{b % 250 + 1}"
        servers = "".join(f"    server r{i} {address}:{8000 + i} check\n" for i in range(per_backend))
        parts.append(f"\nbackend b{b}\n    balance leastconn\n{servers}")
    return "".join(parts)


def fleet_dead() -> dict[str, int]:
    """How many servers are dead per backend in the fleet drain: 1,000 in all. 10 backends lost
    every server, 100 lost 3, 600 lost 1; the rest are untouched."""
    dead = {f"b{b}": FLEET_PER_BACKEND for b in range(10)}
    dead.update({f"b{b}": 3 for b in range(10, 110)})
    dead.update({f"b{b}": 1 for b in range(110, 710)})
    return dead


def fleet_state(now: datetime | None = None, old_workers: int = 50) -> State:
    """A daemon after a drain at fleet size: 10,000 servers, 1,000 dead, `old_workers` old
    workers each steered away from every dead server, and an hour of chart history."""
    now = now or utcnow()
    state = running_state(now)
    text = fleet_config()
    generation = _generation_of(text, 1, now - timedelta(minutes=50), OLD_PIDS[0])
    dead = sorted(f"{backend}/r{i}" for backend, count in fleet_dead().items() for i in range(count))
    state.generations = {}
    state.old_workers = {}
    for n in range(1, old_workers + 2):
        # Every generation runs the same servers (a fleet reloads for many reasons); the
        # content-keyed caches see one config.
        state.generations[n] = Generation(
            n, generation.model, generation.effective_sha256, generation.rendered_sha256,
            now - timedelta(minutes=old_workers + 1 - n), 50000 + n,
        )
        if n <= old_workers:
            state.old_workers[50000 + n] = OldWorker(
                50000 + n, n, now - timedelta(minutes=old_workers + 1 - n), rss_bytes=180 * 1024 * 1024,
                connections=n % 7, steered=list(dead), push=PushState("ok", now - timedelta(seconds=2)),
            )
    state.current_generation = old_workers + 1
    state.rendered_sha256 = state.last_good_sha256 = generation.effective_sha256
    state.dead_servers = set(dead)
    state.operator_dead = {dead[0]}
    for series in (state.reloads.chart, state.push_duration.recent, state.old_worker_counts):
        series.clear()
    for minute in range(60, 0, -1):
        at = now - timedelta(minutes=minute)
        state.reloads.chart.append(ReloadRecord(at, "ok" if minute % 17 else "invalid", 180.0 + minute * 3))
        state.push_duration.recent.append((at, 0.02 + (minute % 5) / 100))
        state.old_worker_counts.append((at, min(old_workers, 60 - minute)))
    return state
