"""Which servers the detector watches: the current config's, and those of every config an
old worker still runs (a server a reload dropped is still reached by that worker)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import replace
from datetime import UTC, datetime

from rigs.netns import needs_netns, run_in_netns
from supervisor.eventloop import finished
from supervisor.haproxy.api import MasterCLI
from supervisor.haproxy.config import Config
from supervisor.settings import DetectorSettings
from supervisor.state import Generation, State
from supervisor.steering.detector import ServerIndex, StalledDetector, merging

OLD = """\
backend app
    server r1 10.0.0.1:8001 check
    server r2 10.0.0.2:8001
    server named example.com:80
    server off 10.0.0.9:80 disabled
backend other
    server r1 10.0.0.1:8001
"""
NEW = """\
backend app
    server r1 10.0.0.1:8001 check
    server r3 [::1]:9000
"""


def generation(number: int, text: str) -> Generation:
    return Generation(number, Config.parse(text), f"sha{number}", f"r{number}", datetime.now(UTC))


def test_servers_by_endpoint_as_their_sockets_name_them():
    index = finished(ServerIndex.building(generation(1, OLD)))
    assert index.by_endpoint == {
        ("10.0.0.1", 8001): ("app/r1", "other/r1"), ("10.0.0.2", 8001): ("app/r2",),
    }  # a host name and a disabled server are left out
    assert index.checked == {"app/r1"} and index.ports == {8001} and index.families == (socket.AF_INET,)


def test_every_running_config_is_watched():
    old, new = finished(ServerIndex.building(generation(1, OLD))), finished(ServerIndex.building(generation(2, NEW)))
    both = finished(merging([old, new]))
    assert both.by_endpoint[("10.0.0.2", 8001)] == ("app/r2",)  # only the old worker routes there
    assert both.by_endpoint[("::1", 9000)] == ("app/r3",)
    assert both.by_endpoint[("10.0.0.1", 8001)] == ("app/r1", "other/r1")
    assert both.ports == {8001, 9000} and both.families == (socket.AF_INET, socket.AF_INET6)
    assert both.keys == {"app/r1", "app/r2", "other/r1", "app/r3"}



def test_merged_configs_share_what_they_hold_alike():
    """A reload apart, configs mostly name the same servers: the merge holds the first index's
    objects where it comes out equal, and its own only where the configs differ."""
    first = finished(ServerIndex.building(generation(1, OLD)))
    again = finished(ServerIndex.building(generation(2, OLD)))
    both = finished(merging([first, again]))
    assert both.by_endpoint == first.by_endpoint
    assert all(both.by_endpoint[e] is keys for e, keys in first.by_endpoint.items())
    assert both.keys is first.keys and both.checked is first.checked and both.ports is first.ports
    grown = finished(merging([first, finished(ServerIndex.building(generation(3, NEW)))]))
    assert grown.by_endpoint[("10.0.0.2", 8001)] is first.by_endpoint[("10.0.0.2", 8001)]
    assert grown.keys is not first.keys and grown.keys > first.keys

async def test_a_config_stays_watched_while_a_worker_runs_it_and_no_longer():
    state = State()
    detector = StalledDetector(DetectorSettings(), state, MasterCLI("/nonexistent/master.sock"))
    state.publish_generation(replace(generation(1, OLD), worker_pid=101), current=True)
    now, watched = await detector.watched_indexes()
    assert watched is now and ("10.0.0.2", 8001) in now.by_endpoint
    # A reload: worker 101 is old and still runs OLD, whose app/r2 the new config dropped.
    state.publish_generation(replace(generation(2, NEW), worker_pid=102), current=True)
    state.publish_old_workers({101: 1}, {101: None})
    now, watched = await detector.watched_indexes()
    assert ("10.0.0.2", 8001) not in now.by_endpoint
    assert watched.by_endpoint[("10.0.0.2", 8001)] == ("app/r2",) and ("::1", 9000) in watched.by_endpoint
    # Worker 101 exits: only the current config is watched.
    state.publish_old_workers({}, {})
    now, watched = await detector.watched_indexes()
    assert watched is now and ("10.0.0.2", 8001) not in watched.by_endpoint


async def test_the_indexes_are_worked_out_again_only_when_what_they_come_from_changed():
    state = State()
    detector = StalledDetector(DetectorSettings(), state, MasterCLI("/nonexistent/master.sock"))
    state.publish_generation(replace(generation(1, OLD), worker_pid=101), current=True)
    first = await detector.watched_indexes()
    assert await detector.watched_indexes() is first  # at rest: the same answer, nothing looked at
    state.publish_generation(replace(generation(2, NEW), worker_pid=102), current=True)
    state.publish_old_workers({101: 1}, {101: None})
    second = await detector.watched_indexes()
    assert second is not first and ("::1", 9000) in second[1].by_endpoint
    assert await detector.watched_indexes() is second
    # The old worker's generation, a new value of it (not the current one) with a new server.
    state.publish_generation(
        replace(generation(1, OLD + "    server r7 10.0.0.7:8001\n"), worker_pid=101, effective_sha256="sha1b")
    )
    third = await detector.watched_indexes()
    assert ("10.0.0.7", 8001) in third[1].by_endpoint
    # The old worker gone, written straight into the state as some test supports do.
    del state.old_workers[101]
    now, watched = await detector.watched_indexes()
    assert watched is now and ("10.0.0.7", 8001) not in watched.by_endpoint


async def _polls_at_rest() -> list[int]:
    """The detector's poll count: after 15 ticks with nothing to watch; once a config is
    published and indexed; 15 ticks later; after connects refused; after a connect."""
    state = State()
    settings = DetectorSettings(poll_interval_ms=10)  # at rest, a look every 20 ms
    detector = StalledDetector(settings, state, MasterCLI("/nonexistent/master.sock"))
    polls = 0
    real_poll = detector.poll

    async def counted() -> None:
        nonlocal polls
        polls += 1
        await real_poll()

    detector.poll = counted  # type: ignore[method-assign]
    seen = []
    task = asyncio.create_task(detector.run())
    try:
        await asyncio.sleep(0.15)
        seen.append(polls)
        with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_server(("127.0.0.1", 0)) as gone:
            port, closed_port = listener.getsockname()[1], gone.getsockname()[1]
            gone.close()
            config = f"backend app\n    server r1 127.0.0.1:{port}\n    server r2 127.0.0.1:{closed_port}\n"
            state.publish_generation(replace(generation(1, config), worker_pid=101), current=True)
            await asyncio.sleep(0.15)
            seen.append(polls)
            await asyncio.sleep(0.15)
            seen.append(polls)
            for _ in range(20):  # as checks of a server whose port is closed: each connect fails at once
                with socket.socket() as refused, contextlib.suppress(ConnectionRefusedError):
                    refused.connect(("127.0.0.1", closed_port))
                await asyncio.sleep(0.01)
            seen.append(polls)
            with socket.create_connection(("127.0.0.1", port)):  # ActiveOpens moves, AttemptFails does not
                await asyncio.sleep(0.1)
            seen.append(polls)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return seen


@needs_netns
def test_at_rest_the_detector_task_is_woken_only_for_work():
    """Its look at each tick is a plain timer callback; a poll runs when the configs change or
    a connect begins in the namespace that has not already failed (ActiveOpens, AttemptFails),
    not every tick. In a namespace of its own: nothing else opens connections there."""
    first, indexed, later, refused, connected = run_in_netns(lambda: asyncio.run(_polls_at_rest()), timeout=30)
    assert first == 1  # nothing to watch: no poll after the first
    assert 2 <= indexed <= 3  # the new config indexed, the counters read once
    assert later == indexed  # at rest: 15 ticks, no poll
    assert refused == later  # connects that failed at once leave nothing to stall
    assert connected > refused
