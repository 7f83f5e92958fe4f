"""End to end: a displaced worker marks a vanished server DOWN through the injected
`observe` directive and serves from the backup. The control shows the same worker
without the directive keeps sending requests to the vanished server."""

from __future__ import annotations

import pytest

from rigs.harness import HAProxyMaster, KeepAliveClient, VanishedNode, backends, free_port
from supervisor.effective import build_effective
from supervisor.haproxy.answers import parse_servers_state
from supervisor.settings import ObserveSettings, OldWorkerSettings, Settings

pytestmark = pytest.mark.haproxy

RENDERED = """\
global
    close-spread-time infinite
    hard-stop-after 120s

defaults
    mode http
    timeout connect 200ms
    timeout client 10s
    timeout server 10s
    retries 1
    option idle-close-on-response

frontend fe
    bind 127.0.0.1:{front}
    default_backend app

backend app
    balance roundrobin
    server r1 127.0.0.1:{r1} check inter 300ms
    server fallback {fallback} backup
"""


async def drain_on_old_worker(
    rundir, observe: bool, rendered: str = RENDERED
) -> tuple[list[tuple[int, str, float]], str]:
    front, r1_port = free_port(), free_port()
    with backends("fallback") as started:
        rendered = rendered.format(front=front, r1=r1_port, fallback=started["fallback"].address)
        settings = Settings(
            observe=ObserveSettings(enabled=observe, error_limit=2),
            old_workers=OldWorkerSettings(guard=False),
        )
        effective = build_effective(settings, rendered).text
        assert ("observe layer4 error-limit 2 on-error mark-down" in effective) is observe
        cfg = rundir / "haproxy.cfg"
        cfg.write_text(effective)
        with backends("r1") as primary:
            # r1 must live on its reserved port: restart it there.
            primary["r1"].stop()
            primary["r1"].port = r1_port
            primary["r1"].start()
            master = HAProxyMaster(cfg, rundir).start()
            try:
                # Several keep-alive clients: the one whose request reaches the error limit
                # loses its connection; the others go on through the same old worker.
                # A request that fails on connect loses its connection, so one more idle
                # client keeps the old worker alive until its state has been read.
                clients = [await KeepAliveClient(front).connect() for _ in range(4)]
                keeper = await KeepAliveClient(front).connect()
                for client in [*clients, keeper]:
                    status, body, _ = await client.get()
                    assert (status, body) == (200, "r1")
                old_pid, _ = master.worker_pids()
                master.reload()
                assert old_pid in master.worker_pids()[1], "the first worker should now be old"
                primary["r1"].stop()
                vanished = VanishedNode(r1_port)
                try:
                    assert vanished.connect_hangs()
                    answers = [await client.get(timeout=5) for client in clients]
                    state = master.command(f"@!{old_pid} show servers state app")
                finally:
                    vanished.close()
                for client in [*clients, keeper]:
                    await client.close()
            finally:
                master.stop()
    return answers, state


async def test_old_worker_marks_vanished_server_down_and_uses_backup(rundir):
    answers, state = await drain_on_old_worker(rundir, observe=True)
    r1 = {s.name: s for s in parse_servers_state(state)}.get("r1")
    assert r1 is not None, (state, answers)
    assert r1.op_state == 0, f"observe should have marked r1 DOWN in the old worker: {state}"
    # The request that reaches the error limit pays the connect timeouts; after it,
    # requests go to the backup without waiting on the vanished server.
    assert answers[0][0] != 200 and answers[0][2] >= 0.2, answers
    for status, body, seconds in answers[1:]:
        assert (status, body) == (200, "fallback"), answers
        assert seconds < 0.15, answers


async def test_control_without_observe_old_worker_keeps_using_vanished_server(rundir):
    answers, state = await drain_on_old_worker(rundir, observe=False)
    r1 = {s.name: s for s in parse_servers_state(state)}.get("r1")
    assert r1 is not None, (state, answers)
    assert r1.op_state != 0, "without observe nothing can mark r1 down in an old worker"
    assert all(a[1] != "fallback" for a in answers), answers
    # every request paid the connect timeouts and failed
    assert all(a[0] != 200 and a[2] >= 0.2 for a in answers), answers
