"""A condition that recurs on every poll is one log line when it starts or its cause changes,
at most one a minute while it lasts (with a count), and one when it is over:
logs.RecurringCondition, its keyed form logs.RecurringConditions (the reloader's disk errors),
and the old workers' poll of the master CLI, which used to warn four times a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import pytest

from rigs.harness import HAProxyMaster, free_port
from supervisor.haproxy.api import MasterCLI
from supervisor.logs import RecurringCondition, RecurringConditions
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings
from supervisor.state import State
from supervisor.steering.workers import OldWorkers

LOGGER = "test.recurring"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture, name: str, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno >= level]


def test_one_line_at_the_start_then_one_a_minute_with_a_count_then_the_all_clear(caplog):
    caplog.set_level(logging.DEBUG, LOGGER)
    clock = Clock()
    condition = RecurringCondition(logging.getLogger(LOGGER), logging.WARNING, "cannot: %s", clock=clock)
    for _ in range(240):  # a minute of polls every 250 ms
        condition.happened("Too many open files")
        clock.now += 0.25
    condition.happened("Too many open files")
    assert lines(caplog, LOGGER, logging.WARNING) == [
        "cannot: Too many open files",
        "cannot: Too many open files (240 times since the last report)",
    ]
    condition.over("works again")
    condition.over("works again")
    assert lines(caplog, LOGGER)[-1] == "works again"
    assert lines(caplog, LOGGER).count("works again") == 1
    # Flapping within the minute is counted, not logged: one line a minute at most.
    clock.now += 1
    condition.happened("Too many open files")
    assert len(lines(caplog, LOGGER, logging.WARNING)) == 2
    clock.now += 60
    condition.happened("Too many open files")
    assert lines(caplog, LOGGER, logging.WARNING)[-1] == "cannot: Too many open files (2 times since the last report)"


def test_a_new_cause_is_logged_at_once_the_same_one_once_a_minute(caplog):
    caplog.set_level(logging.DEBUG, LOGGER)
    clock = Clock()
    condition = RecurringCondition(logging.getLogger(LOGGER), logging.ERROR, "cannot write: %s", clock=clock)
    condition.happened("No space left on device", cause="ENOSPC")
    clock.now += 1
    condition.happened("No space left on device", cause="ENOSPC")
    condition.happened("Permission denied", cause="EACCES")
    clock.now += 1
    condition.happened("Permission denied", cause="EACCES")
    assert lines(caplog, LOGGER, logging.ERROR) == [
        "cannot write: No space left on device",
        "cannot write: Permission denied (2 times since the last report)",
    ]
    # Over, then back with a new cause: said at once; with the cause last logged: within the minute, counted.
    condition.over("works again")
    condition.happened("No space left on device", cause="ENOSPC")
    condition.over("works again")
    condition.happened("No space left on device", cause="ENOSPC")
    assert lines(caplog, LOGGER) == [
        "cannot write: No space left on device",
        "cannot write: Permission denied (2 times since the last report)",
        "works again",
        "cannot write: No space left on device (2 times since the last report)",
        "works again",
    ]


def test_keyed_conditions_are_apart_and_remind_with_their_latest_wording(caplog):
    caplog.set_level(logging.DEBUG, LOGGER)
    clock = Clock()
    problems = RecurringConditions(logging.getLogger(LOGGER), logging.ERROR, clock=clock)
    for number in range(2, 6):  # one failed write per reload, on a full disk
        problems.happened("generation configs", "ENOSPC", f"cannot record generation {number}'s config")
        problems.happened("generations index", "ENOSPC", "cannot record the generations")
        clock.now += 20
    assert lines(caplog, LOGGER) == [
        "cannot record generation 2's config",
        "cannot record the generations",
        "cannot record generation 5's config (3 times since the last report)",
        "cannot record the generations (3 times since the last report)",
    ]
    problems.over("generation configs")
    problems.over("generation configs")
    problems.over("runtime_dir")  # never failed: nothing to say
    assert lines(caplog, LOGGER)[4:] == ["generation configs: works again"]
    problems.happened("generations index", "EACCES", "cannot record the generations: Permission denied")
    assert lines(caplog, LOGGER)[-1] == "cannot record the generations: Permission denied"


class WarnAtOnce(OldWorkers):
    WARN_AFTER_S = 0.0  # no grace for a re-executing master: the test's failures last 3 s


RENDERED = """\
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s

frontend web
    bind 127.0.0.1:{port}
    default_backend app

backend app
    server s1 127.0.0.1:{unused}
"""


@pytest.mark.haproxy
async def test_old_workers_poll_failing_for_lack_of_a_master_is_one_warning_then_an_all_clear(rundir: Path, caplog):
    """The master CLI fails on each poll until HAProxy starts on its socket (as it fails on each
    poll while the daemon has no file descriptor left). Control: before the fix, each of those
    polls was a warning."""
    caplog.set_level(logging.DEBUG, "supervisor.steering")
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=rundir), old_workers=OldWorkerSettings(poll_interval_ms=20)
    )
    cli = MasterCLI(rundir / "master.sock", timeout=0.3)  # a poll fails in 0.3 s
    steering = WarnAtOnce(settings, State(), cli)
    cfg = rundir / "haproxy.cfg"
    cfg.write_text(RENDERED.format(port=free_port(), unused=free_port()))
    task = asyncio.create_task(steering.run())
    master = None
    try:
        await asyncio.sleep(3)
        failing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("old workers: master CLI")]
        master = await asyncio.to_thread(HAProxyMaster(cfg, rundir).start)
        for _ in range(50):
            if any("answers again" in line for line in lines(caplog, "supervisor.steering")):
                break
            await asyncio.sleep(0.1)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if master is not None:
            master.stop()
    assert len(failing) >= 5, failing  # it did fail on every poll
    said = lines(caplog, "supervisor.steering")
    clear = "old workers: the master CLI answers again"
    until_clear = said[: said.index(clear)] if clear in said else said
    assert len(until_clear) == 1 and "old workers: the master CLI keeps failing" in until_clear[0], until_clear
    assert clear in said, said
