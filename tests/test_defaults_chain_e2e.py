"""`defaults X from Y` chains against the real binary: what the model resolves is what HAProxy
runs. Two behaviours depend on it in an old worker:

- the guard's flavour: HAProxy runs `be` in HTTP mode through two defaults sections, so a
  fail-fast (`be_n 0`) must answer 503; the TCP flavour (what a chain-blind model injected)
  closes the connection instead, and the client gets an empty reply (the control);
- observe: `default-server check` two defaults up gives the server its check, so `observe`
  is injected and the old worker marks a vanished server down; without it (the control) every
  request waits on the vanished server.
"""

from __future__ import annotations

import dataclasses

import pytest

from rigs.harness import HAProxyMaster, KeepAliveClient, backends, free_port
from supervisor.effective import build_effective, prepare_runtime_dir, write_slot_table
from supervisor.files import write_atomically
from supervisor.haproxy.answers import parse_servers_state
from supervisor.haproxy.api import MasterCLI
from supervisor.haproxy.guard import guard_rules
from supervisor.settings import HAProxySettings, ObserveSettings, OldWorkerSettings, Settings
from supervisor.steering.mapdiff import Phase, phase_lines
from tests.test_observe_e2e import drain_on_old_worker

pytestmark = pytest.mark.haproxy

# `close-spread-time infinite`: the old worker keeps the clients it holds until hard-stop-after.
# With a window HAProxy closes each at a random moment in it, and a test that counts the
# answers on a held connection fails at random (see tests/support/old_worker.py).
GUARDED = """\
global
    hard-stop-after 60s
    close-spread-time infinite

defaults common
    mode http
    timeout connect 500ms
    timeout client 10s
    timeout server 10s

defaults def_back from common
    option idle-close-on-response

frontend web from def_back
    bind 127.0.0.1:{web}
    default_backend be

backend be from def_back
    server s1 {s1}
"""


async def _fail_fast_in_old_worker(rundir, chain_blind: bool) -> list[tuple[int, str, float]]:
    settings = Settings(haproxy=HAProxySettings(runtime_dir=rundir), old_workers=OldWorkerSettings(guard=True))
    prepare_runtime_dir(settings)
    web = free_port()
    with backends("s1") as b:
        effective = build_effective(settings, GUARDED.format(web=web, s1=b["s1"].address))
        map_path, table = str(settings.haproxy.steer_map), effective.slot_table
        assert table is not None
        http_rules, tcp_rules = (guard_rules(mode, map_path, str(table.path)) for mode in ("http", "tcp"))
        assert all(rule in effective.text for rule in http_rules), effective.text
        if chain_blind:
            # The control: the TCP flavour, as the model put it when it read `be` as TCP.
            text = effective.text
            for http_rule, tcp_rule in zip(http_rules, tcp_rules, strict=True):
                text = text.replace(http_rule, tcp_rule)
            effective = dataclasses.replace(effective, text=text)
        write_slot_table(effective.slot_table)
        write_atomically(settings.haproxy.effective_config, effective.text)
        master = HAProxyMaster(settings.haproxy.effective_config, rundir).start()
        clients: list[KeepAliveClient] = []
        try:
            clients = [await KeepAliveClient(web).connect() for _ in range(3)]
            for client in clients:
                assert (await client.get())[:2] == (200, "s1")
            old_pid, _ = master.worker_pids()
            assert old_pid is not None
            master.reload()
            cli = MasterCLI(master.socket)
            for line in phase_lines(old_pid, map_path, Phase(adds=(("be_n", "0"),), sets=())):
                assert (await cli.execute(line)).strip() == ""
            return [await client.get(timeout=5) for client in clients]
        finally:
            for client in clients:
                await client.close()
            master.stop()


async def test_guard_in_a_backend_whose_mode_comes_through_a_chain_answers_503(rundir):
    answers = await _fail_fast_in_old_worker(rundir, chain_blind=False)
    assert [status for status, _, _ in answers] == [503, 503, 503], answers
    assert all(seconds < 0.25 for _, _, seconds in answers), answers


async def test_control_the_tcp_flavour_in_that_backend_closes_the_connection(rundir):
    answers = await _fail_fast_in_old_worker(rundir, chain_blind=True)
    assert [status for status, _, _ in answers] == [0, 0, 0], answers  # an empty reply


# The backend's check comes from `default-server` two defaults up; `app` names no defaults,
# so it takes the last one (web), which copied base's.
OBSERVED = """\
global
    close-spread-time infinite
    hard-stop-after 120s

defaults base
    mode http
    timeout connect 200ms
    timeout client 10s
    timeout server 10s
    retries 1
    default-server check inter 300ms

defaults web from base
    option idle-close-on-response

frontend fe
    bind 127.0.0.1:{front}
    default_backend app

backend app
    balance roundrobin
    server r1 127.0.0.1:{r1}
    server fallback {fallback} backup
"""


async def test_check_through_a_chain_gets_observe_and_the_old_worker_marks_down(rundir):
    answers, state = await drain_on_old_worker(rundir, observe=True, rendered=OBSERVED)
    r1 = {s.name: s for s in parse_servers_state(state)}["r1"]
    assert r1.op_state == 0, f"observe should have marked r1 DOWN in the old worker: {state}"
    for status, body, seconds in answers[1:]:
        assert (status, body) == (200, "fallback") and seconds < 0.15, answers


async def test_control_the_same_chain_without_observe_keeps_waiting_on_the_vanished_server(rundir):
    answers, state = await drain_on_old_worker(rundir, observe=False, rendered=OBSERVED)
    r1 = {s.name: s for s in parse_servers_state(state)}["r1"]
    assert r1.op_state != 0
    assert all(a[0] != 200 and a[2] >= 0.2 for a in answers), answers


def test_observe_is_injected_through_the_chain():
    settings = Settings(
        observe=ObserveSettings(enabled=True, error_limit=2), old_workers=OldWorkerSettings(guard=False)
    )
    text = build_effective(settings, OBSERVED.format(front=1, r1=2, fallback="127.0.0.1:3")).text
    assert "server r1 127.0.0.1:2 observe layer4 error-limit 2 on-error mark-down\n" in text
    assert "server fallback 127.0.0.1:3 backup\n" in text
