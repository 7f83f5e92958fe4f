"""The injected guard in a real old worker, driven by map entries pushed through the master CLI
in the daemon's own line format: HTTP and TCP backends, spread, backup, fail fast, and no
effect on the current worker."""

from __future__ import annotations

from collections import Counter

import pytest

from rigs.harness import HAProxyMaster, KeepAliveClient, backends, free_port
from rigs.wholes import inject_guard
from supervisor.effective import prepare_runtime_dir, write_slot_table
from supervisor.haproxy.api import MasterCLI
from supervisor.haproxy.config import Config
from supervisor.haproxy.guard import inject_guard_and_table
from supervisor.settings import HAProxySettings, Settings
from supervisor.steering.mapdiff import Phase, map_entries, phase_lines

pytestmark = pytest.mark.haproxy

# `close-spread-time infinite`: the old worker keeps the clients it holds until hard-stop-after.
# With a window HAProxy closes each at a random moment in it, and a test that counts the
# answers on a held connection fails at random (see tests/support/old_worker.py).
RENDERED = """\
global
    hard-stop-after 60s
    close-spread-time infinite

defaults
    timeout connect 500ms
    timeout client 10s
    timeout server 10s

frontend web
    mode http
    option idle-close-on-response
    bind 127.0.0.1:{web}
    default_backend app

# `balance first`: without steering every request goes to r1.
backend app
    mode http
    balance first
    server r1 {r1}
    server r2 {r2}
    server r3 {r3}
    server fallback {fallback} backup

frontend raw
    mode tcp
    bind 127.0.0.1:{raw}
    # Connections accepted before the reload send their first bytes after it, so the
    # backend's rules run in the old worker with the map already filled.
    tcp-request inspect-delay 10s
    tcp-request content accept if {{ req.len gt 0 }}
    default_backend tapp

backend tapp
    mode tcp
    balance first
    server r1 {r1}
    server r2 {r2}
    server fallback {fallback} backup
"""


async def push(
    cli: MasterCLI, pid: int, map_path: str, adds: dict[str, str], sets: dict[str, str] | None = None
) -> None:
    sets = sets or {}
    for line in phase_lines(pid, map_path, Phase(adds=tuple(adds.items()), sets=tuple(sets.items()))):
        assert (await cli.execute(line)).strip() == ""


async def test_guard_steers_http_and_tcp_in_an_old_worker_only(rundir):
    settings = Settings(haproxy=HAProxySettings(runtime_dir=rundir))
    prepare_runtime_dir(settings)
    map_path = str(settings.haproxy.steer_map)
    web, raw = free_port(), free_port()
    with backends("r1", "r2", "r3", "fallback") as b:
        text = RENDERED.format(web=web, raw=raw, **{n: b[n].address for n in b})
        cfg = rundir / "haproxy.cfg"
        # app_0 r1, app_1 r2, app_2 r3; tapp_0 r1, tapp_1 r2
        table = inject_guard_and_table(Config.parse(text), "/run/hs/steer.map", rundir)[1]
        write_slot_table(table)
        cfg.write_text(inject_guard(Config.parse(text), map_path, table.path).render())
        master = HAProxyMaster(cfg, rundir).start()
        clients: list[KeepAliveClient] = []
        try:
            http = [await KeepAliveClient(web).connect() for _ in range(4)]
            tcp = [await KeepAliveClient(raw).connect() for _ in range(4)]
            clients = [*http, *tcp]
            for client in http:
                assert (await client.get())[:2] == (200, "r1")
            old_pid = master.reload() and master.worker_pids()[1][0]
            cli = MasterCLI(master.socket)
            assert map_entries(await cli.on(old_pid, f"show map {map_path}")) == {}

            # Empty map: the old worker routes by its config.
            assert (await http[0].get())[:2] == (200, "r1")
            # A count alone spreads over the slot table's servers (`balance first` would pick r1).
            await push(cli, old_pid, map_path, {"app_n": "3"})
            spread = Counter([(await http[0].get())[1] for _ in range(45)])
            assert set(spread) == {"r1", "r2", "r3"} and min(spread.values()) >= 5, spread
            # An override replaces one slot's server, as the fallback of a draw: a drawn slot
            # the steer map overrides is drawn again (twice at most), so r2's slot takes most.
            await push(cli, old_pid, map_path, {"app_0": "r3"}, {"app_n": "2"})
            spread = Counter([(await http[0].get())[1] for _ in range(60)])
            assert set(spread) <= {"r2", "r3"} and spread["r2"] >= 42, spread
            # A draw slot past the table's end (r1 r2 r3) is the steer map's alone, and is not
            # drawn again: slots 1 (r2), 2 (r3) and 3 (r3) take the draws.
            await push(cli, old_pid, map_path, {"app_3": "r3"}, {"app_n": "4"})
            spread = Counter([(await http[0].get())[1] for _ in range(60)])
            assert set(spread) <= {"r2", "r3"} and min(spread.values()) >= 8, spread
            # A hop replaces the server a slot resolves to, by steer map (r3) or by table (r2).
            await push(cli, old_pid, map_path, {"app/r3": "r1", "app/r2": "r1"})
            assert {(await http[0].get())[1] for _ in range(10)} == {"r1"}
            await cli.execute(f"@!{old_pid} del map {map_path} app/r2")
            spread = Counter([(await http[0].get())[1] for _ in range(45)])
            assert set(spread) == {"r1", "r2"} and min(spread.values()) >= 5, spread
            await cli.execute(f"@!{old_pid} del map {map_path} app/r3")
            # All to the backup, which a `use-server` reaches in an old worker.
            await push(cli, old_pid, map_path, {}, {"app_0": "fallback", "app_n": "1"})
            assert {(await http[1].get())[:2] for _ in range(5)} == {(200, "fallback")}
            # Fail fast: an answer at once, and the connection stays usable.
            await push(cli, old_pid, map_path, {}, {"app_n": "0"})
            for _ in range(3):
                status, _, seconds = await http[2].get()
                assert status == 503 and seconds < 0.25

            # The current worker never sees the old worker's entries.
            fresh = await KeepAliveClient(web).connect()
            clients.append(fresh)
            assert {(await fresh.get())[:2] for _ in range(3)} == {(200, "r1")}

            # TCP: steered to r2, then to the backup, then refused.
            await push(cli, old_pid, map_path, {"tapp_0": "r2", "tapp_n": "1"})
            assert (await tcp[0].get())[:2] == (200, "r2")
            await push(cli, old_pid, map_path, {}, {"tapp_0": "fallback"})
            assert (await tcp[1].get())[:2] == (200, "fallback")
            await push(cli, old_pid, map_path, {}, {"tapp_n": "0"})
            status, _, seconds = await tcp[2].get()
            assert status == 0 and seconds < 0.25  # connection closed at once
            # Control: with the TCP entries gone the old worker's own balancing picks r1.
            await cli.execute(f"@!{old_pid} del map {map_path} tapp_n")
            assert (await tcp[3].get())[:2] == (200, "r1")
        finally:
            for client in clients:
                await client.close()
            master.stop()
