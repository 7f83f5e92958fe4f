"""A State that looks like a daemon that has been running for an hour, and a recording `actions`.

Three generations from the corpus: generation 1 (handwritten_basic.cfg) and 2
(rayserve.cfg) still run in old workers, generation 3 (rayserve.cfg) in the current
worker. Times are relative to `now`, so unit tests can pin the clock.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from supervisor.haproxy.config import Config
from supervisor.state import Generation, OldWorker, PushState, ReloadRecord, ReloadResult, State, utcnow
from tests.conftest import CORPUS

MASTER_PID = 41000
CURRENT_PID = 41203
OLD_PIDS = (41101, 41102)  # oldest first
# A reload error as `haproxy -c` prints it: config text an operator wrote, markup included.
HOSTILE_ERROR = "[ALERT] parsing [haproxy.cfg:12]: unknown keyword '<script>alert(1)</script>' in 'backend'"


def _generation(number: int, corpus_file: str, started_at: datetime, worker_pid: int) -> Generation:
    text = (CORPUS / corpus_file).read_text()
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
        rendered_path="/etc/haproxy/rendered/haproxy.cfg",
        effective_path="/run/haproxy-supervisor/haproxy.cfg",
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
    state.push_failures = 2
    for seconds in (0.003, 0.02, 0.02, 0.2, 3.0):
        state.push_duration.observe(seconds)
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
