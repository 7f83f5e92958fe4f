"""The reloader's contract with the components plugged into it, in-process with the real HAProxy.

prepare gets the next effective config while `haproxy -c` checks it (whatever the verdict) and
returns a plan; before_reload gets that plan before the reload, after_reload what before_reload
returned and the outcome;
a runtime_apply whose outcome is applied replaces the reload (no new worker, the same
generation with what it now runs, `runtime_applied` recorded); reload_now() reloads unchanged
content and returns its record.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from rigs.daemon import write_atomic
from rigs.harness import haproxy_binary
from supervisor.effective import ConfigCheck, Effective, prepare_runtime_dir, start_effective_check
from supervisor.haproxy.api import MasterCLI
from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.hook import RuntimeOutcome
from supervisor.master.process import MasterProcess
from supervisor.reloader import Reloader
from supervisor.settings import HAProxySettings, OldWorkerSettings, ReloadSettings, Settings
from supervisor.state import Generation, State

pytestmark = pytest.mark.haproxy

RENDERED = """\
global
    hard-stop-after 5s
defaults
    mode http
    timeout connect 200ms
    timeout client 5s
    timeout server 5s
frontend fe
    bind 127.0.0.1:{front}
    default_backend app
backend app
    server s1 127.0.0.1:{port}
"""


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.handed: list[object] = []  # the plan each after_reload was handed
        self.checking: list[bool] = []  # per prepare: was a `haproxy -c` started and its verdict not taken
        self.pending_checks = 0
        self.collecting: list[bool] = []  # per prepare: was the garbage collector on

    async def prepare(self, effective: Effective) -> tuple[str, list[str]]:
        servers = [s.key for s in effective.effective_model.servers()]
        self.calls.append(("prepare", servers))
        # By the check's own life, not by looking for the process: a small config's `haproxy -c`
        # can be done (and reaped) in a few ms, before prepare runs, on a fast build such as 3.0.
        self.checking.append(self.pending_checks > 0)
        self.collecting.append(gc.isenabled())
        return ("planned", servers)

    async def before_reload(self, plan: tuple[str, list[str]]) -> tuple[str, list[str]]:
        self.calls.append(("before", plan[1]))
        return ("steered", plan[1])

    async def after_reload(self, plan: tuple[str, list[str]] | None, ok: bool) -> None:
        self.handed.append(plan)
        self.calls.append(("after", ok))

    async def refresh(self) -> None:
        self.calls.append(("refresh", None))


def counting_checks(hooks: Recorder):
    """start_effective_check as the reloader calls it, counting the checks whose verdict is pending."""

    async def start(*args: object) -> ConfigCheck:
        check = await start_effective_check(*args)  # type: ignore[arg-type]
        hooks.pending_checks += 1
        verdict = check.verdict

        async def taken() -> tuple[bool, str]:
            try:
                return await verdict()
            finally:
                hooks.pending_checks -= 1

        check.verdict = taken  # type: ignore[method-assign]
        return check

    return start


async def wait_until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@dataclass
class Rig:
    rendered: Path
    front: int
    state: State
    reloader: Reloader
    hooks: Recorder
    applied: list[tuple[int, list[str]]]
    cli: MasterCLI


@contextlib.asynccontextmanager
async def running(rundir: Path, apply_at_runtime: bool):
    from rigs.harness import free_port

    rendered = rundir / "rendered.cfg"
    front = free_port()
    rendered.write_text(RENDERED.format(front=front, port=9))
    settings = Settings(
        haproxy=HAProxySettings(binary=haproxy_binary(), config=rendered, runtime_dir=rundir / "run"),
        reload=ReloadSettings(debounce_ms=50, min_interval_ms=0, timeout_s=10),
        old_workers=OldWorkerSettings(guard=False),
    )
    prepare_runtime_dir(settings)
    state = State()
    cli = MasterCLI(settings.haproxy.master_socket_path)
    hooks = Recorder()
    applied: list[tuple[int, list[str]]] = []

    async def runtime_apply(current: Generation, model: Config) -> RuntimeOutcome:
        # Stand-in for haproxy/runtime/: claims address-only changes, as the real one would plan them.
        applied.append((current.number, [f"{s.key}={s.endpoint}" for s in model.servers()]))
        return RuntimeOutcome(True, model) if apply_at_runtime else RuntimeOutcome(False)

    master = MasterProcess(settings, state, cli)
    reloader = Reloader(settings, state, cli, master, hooks, runtime_apply=runtime_apply)
    master.on_started = reloader.on_master_started
    patched = mock.patch("supervisor.reloader.cycle.start_effective_check", counting_checks(hooks))
    patched.start()
    tasks = [asyncio.create_task(master.run()), asyncio.create_task(reloader.run())]
    try:
        await reloader.reload_now(reason="startup")  # as the daemon starts it
        await wait_until(lambda: state.current is not None)
        yield Rig(rendered, front, state, reloader, hooks, applied, cli)
    finally:
        await master.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        patched.stop()


async def test_runtime_apply_true_replaces_the_reload(rundir: Path):
    async with running(rundir, apply_at_runtime=True) as rig:
        rendered, front, state, hooks, applied = rig.rendered, rig.front, rig.state, rig.hooks, rig.applied
        cli = rig.cli
        first = state.current
        assert first is not None and first.number == 1
        worker = first.worker_pid
        write_atomic(rendered, RENDERED.format(front=front, port=10))
        await wait_until(lambda: state.reloads.runtime_applied == 1)
        assert applied == [(1, ["app/s1=127.0.0.1:10"])]
        current = state.current
        assert current is not None and current.number == 1 and current.worker_pid == worker
        assert current.started_at == first.started_at, "the same generation, a new value"
        assert current.model.server_map()["app/s1"].port == 10
        effective = (rundir / "run" / "haproxy.cfg").read_text()
        assert "127.0.0.1:10" in effective and current.effective_sha256 == state.last_good_sha256
        assert (rundir / "run" / "generations" / "1.cfg").read_text() == effective
        assert hooks.calls == [("prepare", ["app/s1"]), ("refresh", None)], "no reload, no before/after"
        assert hooks.checking == [True]
        procs = await cli.show_proc()
        assert procs.master is not None and procs.master.reloads == 0
        assert procs.current_worker is not None and procs.current_worker.pid == worker


async def test_runtime_apply_false_reloads_with_hooks_around(rundir: Path):
    async with running(rundir, apply_at_runtime=False) as rig:
        rendered, front, state, hooks, applied = rig.rendered, rig.front, rig.state, rig.hooks, rig.applied
        reloader = rig.reloader
        write_atomic(rendered, RENDERED.format(front=front, port=11).replace("server s1", "server s2"))
        await wait_until(lambda: state.reloads.ok == 1)
        assert applied, "runtime_apply is asked first"
        assert hooks.calls == [("prepare", ["app/s2"]), ("before", ["app/s2"]), ("after", True)]
        assert hooks.handed == [("steered", ["app/s2"])]  # what before_reload returned
        assert hooks.checking == [True]
        assert state.current is not None and state.current.number == 2
        assert [s.key for s in state.current.model.servers()] == ["app/s2"]
        # Forced: same content, still a reload, never offered to runtime_apply.
        asked = len(applied)
        record = await reloader.reload_now(reason="test")
        assert record is not None and record.result == "ok"
        assert len(applied) == asked
        assert state.current.number == 3
        assert hooks.calls[-3:] == [("prepare", ["app/s2"]), ("before", ["app/s2"]), ("after", True)]
        # An invalid change is prepared (while the check runs) and goes no further.
        write_atomic(rendered, "frontend broken\n    bind :notaport\n")
        await wait_until(lambda: state.reloads.invalid == 1)
        assert hooks.calls[6:] == [("prepare", [])]
        assert hooks.checking == [True, True, True]
        assert hooks.collecting == [False, False, False]  # eventloop.collector_paused: paused in the cycle
        assert state.reloads.last is not None and "notaport" in (state.reloads.last.error or "")


async def test_the_first_generation_shares_its_lines_with_the_next(rundir: Path):
    # The master's first worker runs the config the daemon built, not a parse of its own:
    # at 100,000 servers a second parse kept alive for generation 1 held a whole config's lines.
    async with running(rundir, apply_at_runtime=False) as rig:
        state = rig.state
        assert state.current is not None and state.current.number == 1
        first = next((s for s in state.current.model.backends() if s.name == "app"), None)
        write_atomic(rig.rendered, RENDERED.format(front=rig.front, port=9).replace("    hard-stop-after 5s\n",
                                                                                     "    hard-stop-after 6s\n"))
        await wait_until(lambda: state.reloads.ok == 1)
        assert state.current.number == 2
        second = next((s for s in state.current.model.backends() if s.name == "app"), None)
        assert first is not None and second is not None
        assert first.body[0].raw == second.body[0].raw
        assert first.body[0] is second.body[0]
