"""Server state across reloads: the injection and the filter of the saved state (pure)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from rigs.wholes import filter_server_state, server_state_target
from supervisor.effective import build_effective, effective_config_and_table
from supervisor.haproxy import server_state
from supervisor.haproxy.config import Config
from supervisor.haproxy.server_state import EMPTY_STATE, inject_server_state, save_server_state, server_state_parts
from supervisor.settings import HAProxySettings, OldWorkerSettings, ReloadSettings, Settings
from tests.conftest import corpus_files

STATE_PATH = Path("/run/hs/server-state")

HEADER = (
    "# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
    "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
    "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl "
    "srv_check_port srv_check_addr srv_agent_addr srv_agent_port"
)


def row(name: str, addr: str, port: int, op: int = 2, admin: int = 0, uweight: int = 1, iweight: int = 1) -> str:
    return f"3 app 1 {name} {addr} {op} {admin} {uweight} {iweight} 5 1 0 2 0 0 0 0 - {port} - 0 0 - - 0"


def state(*rows: str) -> str:
    # The shape `show servers state` answers: version, header, rows, an empty line.
    return "1\n" + HEADER + "\n" + "".join(r + "\n" for r in rows) + "\n"


def kept(text: str) -> list[str]:
    return [line.split()[3] for line in text.splitlines()[2:]]


BASE = """\
backend app
    server up 127.0.0.1:8001
    server down 127.0.0.1:8002 check
    server opmaint 127.0.0.1:8003
    server slot1 127.0.0.1:1 disabled
    server named app.internal:8005
"""


# ---------------------------------------------------------------- injection


def test_injects_state_file_in_global_and_loading_in_defaults():
    text = "global\n    maxconn 10\n\ndefaults\n    mode http\n\nbackend b\n    server s 127.0.0.1:1\n"
    out = inject_server_state(Config.parse(text), STATE_PATH).render()
    assert out == (
        "global\n    maxconn 10\n    server-state-file /run/hs/server-state\n\n"
        "defaults\n    mode http\n    load-server-state-from-file global\n\n"
        "backend b\n    server s 127.0.0.1:1\n"
    )


def test_every_defaults_section_and_orphan_backends_load_it():
    text = (
        "backend early\n  server a 127.0.0.1:1\n"
        "defaults\n  mode tcp\ndefaults named\n  mode http\nbackend b from named\n"
    )
    out = Config.parse(inject_server_state(Config.parse(text), STATE_PATH).render())
    loading = [s.name or s.kind for s in out.sections if any(
        line.keyword == "load-server-state-from-file" for line in s.body
    )]
    assert loading == ["early", "defaults", "named"]
    assert out.sections[1].kind == "global"  # created, first section


def test_keeps_crlf_and_indentation_and_handles_missing_final_newline():
    text = "global\r\n\tmaxconn 10\r\ndefaults\r\n\tmode http"
    out = inject_server_state(Config.parse(text), STATE_PATH).render()
    assert out == (
        "global\r\n\tmaxconn 10\r\n\tserver-state-file /run/hs/server-state\r\n"
        "defaults\r\n\tmode http\r\n\tload-server-state-from-file global\r\n"
    )


def test_rendered_config_that_manages_state_is_left_alone():
    text = "global\n  server-state-file /var/lib/haproxy/state\ndefaults\n  load-server-state-from-file global\n"
    assert inject_server_state(Config.parse(text), STATE_PATH).render() == text
    # Only the missing half is added.
    text = "global\n  maxconn 1\nbackend b\n  load-server-state-from-file none\n  server s 127.0.0.1:1\n"
    out = inject_server_state(Config.parse(text), STATE_PATH).render()
    assert "server-state-file /run/hs/server-state" in out
    assert out.count("load-server-state-from-file") == 1


def test_path_with_spaces_is_quoted():
    out = inject_server_state(Config.parse("global\n"), Path("/run/my dir/state")).render()
    assert "server-state-file '/run/my dir/state'" in out
    assert server_state_target(Config.parse(out)) == Path("/run/my dir/state")


def test_setting_switches_the_injection():
    rendered = Config.parse("global\ndefaults\nbackend b\n  server s 127.0.0.1:1\n")
    on = Settings(haproxy=HAProxySettings(runtime_dir=Path("/run/x")), old_workers=OldWorkerSettings(guard=False))
    off = Settings(reload=ReloadSettings(preserve_server_state=False), old_workers=OldWorkerSettings(guard=False))
    assert "server-state-file /run/x/server-state" in effective_config_and_table(rendered, on)[0].render()
    assert effective_config_and_table(rendered, off)[0].render() == rendered.render()


def test_target_of_the_effective_config():
    assert server_state_target(Config.parse("global\n  server-state-file /a/b\n")) == Path("/a/b")
    assert server_state_target(Config.parse("global\n  server-state-base /s\n  server-state-file b\n")) == Path("/s/b")
    assert server_state_target(Config.parse("global\n  server-state-file b\n")) is None
    assert server_state_target(Config.parse("global\n  maxconn 1\n")) is None


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_injected_corpus_passes_haproxy_check_without_warning(haproxy, tmp_path, path):
    state_file = tmp_path / "server-state"
    state_file.write_text(EMPTY_STATE)
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path), old_workers=OldWorkerSettings(guard=False))
    out = tmp_path / path.name
    out.write_text(build_effective(settings, path.read_text()).text)
    result = subprocess.run([haproxy, "-c", "-f", str(out)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "server state" not in (result.stdout + result.stderr).lower(), result.stdout + result.stderr


# ---------------------------------------------------------------- filter


def test_unchanged_servers_keep_their_runtime_state():
    config = Config.parse(BASE)
    saved = state(
        row("up", "127.0.0.1", 8001),
        row("down", "127.0.0.1", 8002, op=0),
        row("opmaint", "127.0.0.1", 8003, admin=1),  # an operator's maint
        row("slot1", "127.0.0.1", 1, op=0, admin=5),
        row("named", "10.1.2.3", 8005),  # a host name: the file holds the resolved address
    )
    out = filter_server_state(saved, config, config)
    assert kept(out) == ["up", "down", "opmaint", "slot1", "named"]
    assert out.startswith("1\n# be_id ") and out.endswith("\n") and "\n\n" not in out


def test_new_port_is_not_overridden_by_the_file():
    # HAProxy 2.6 takes srv_port from the file over the new config's port.
    new = Config.parse(BASE.replace("127.0.0.1:8001", "127.0.0.1:9001"))
    out = filter_server_state(state(row("up", "127.0.0.1", 8001), row("down", "127.0.0.1", 8002, op=0)),
                              Config.parse(BASE), new)
    assert kept(out) == ["down"]


def test_new_address_starts_fresh():
    new = Config.parse(BASE.replace("127.0.0.1:8002", "127.0.0.2:8002"))
    out = filter_server_state(state(row("down", "127.0.0.1", 8002, op=0)), Config.parse(BASE), new)
    assert kept(out) == []


def test_dropped_servers_are_not_resurrected():
    new = Config.parse(BASE.replace("    server up 127.0.0.1:8001\n", ""))
    out = filter_server_state(state(row("up", "127.0.0.1", 8001), row("gone", "127.0.0.1", 7)), Config.parse(BASE), new)
    assert kept(out) == []


def test_slot_enabled_at_runtime_and_disabled_again_is_not_kept_ready():
    # The worker started with slot1 disabled; the daemon enabled it at runtime (admin 4:
    # "config said disabled", serving). The next config disables it again at the same
    # address: HAProxy would see no config change and keep it ready.
    running = Config.parse(BASE.replace("slot1 127.0.0.1:1 disabled", "slot1 127.0.0.1:1"))
    new = Config.parse(BASE)
    out = filter_server_state(state(row("slot1", "127.0.0.1", 1, admin=4)), running, new)
    assert kept(out) == []


def test_slot_disabled_at_runtime_and_enabled_again_is_not_kept_in_maint():
    # The worker started with `up` enabled; the daemon put it in maint at runtime (admin 1);
    # the next config enables it again: HAProxy would keep the forced maint.
    running = Config.parse(BASE.replace("up 127.0.0.1:8001", "up 127.0.0.1:8001 disabled"))
    out = filter_server_state(state(row("up", "127.0.0.1", 8001, op=0, admin=1)), running, Config.parse(BASE))
    assert kept(out) == []


def test_weight_changed_by_config_is_not_overridden():
    running = Config.parse(BASE.replace("up 127.0.0.1:8001", "up 127.0.0.1:8001 weight 1"))
    new = Config.parse(BASE.replace("up 127.0.0.1:8001", "up 127.0.0.1:8001 weight 5"))
    out = filter_server_state(state(row("up", "127.0.0.1", 8001, uweight=1, iweight=5)), running, new)
    assert kept(out) == []


def test_forgotten_servers_start_from_the_config():
    config = Config.parse(BASE)
    saved = state(row("up", "127.0.0.1", 8001, admin=1), row("down", "127.0.0.1", 8002, op=0))
    assert kept(filter_server_state(saved, config, config, forget={"app/up"})) == ["down"]


def test_ipv6_addresses_compare_as_addresses():
    config = Config.parse("backend app\n  server v6 [::1]:80\n")
    assert kept(filter_server_state(state(row("v6", "0:0::1", 80)), config, config)) == ["v6"]


def test_an_answer_that_is_not_a_state_dump_gives_an_empty_state():
    config = Config.parse(BASE)
    assert filter_server_state("Can't find the target PID matching the prefix '@!1'\n", config, config) == EMPTY_STATE
    assert filter_server_state("", config, config) == EMPTY_STATE


def test_a_big_state_is_filtered_in_parts_that_make_the_whole(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(server_state, "ROWS_PER_PART", 7)
    config = Config.parse("backend app\n" + "".join(f"    server s{i} 127.0.0.1:{i + 1}\n" for i in range(50)))
    saved = state(*(row(f"s{i}", "127.0.0.1", i + 1, op=i % 2 * 2) for i in range(50)))
    whole = filter_server_state(saved, config, config, forget={"app/s3"})
    parts = list(server_state_parts(saved, config, config, {"app/s3"}))
    assert len(parts) == 10 and "".join(parts) == whole
    assert len(kept(whole)) == 49 and "\n\n" not in whole
    everything_forgotten = {f"app/s{i}" for i in range(50)}
    nothing_kept = server_state_parts(saved, config, config, everything_forgotten)
    assert "".join(nothing_kept) == "1\n" + HEADER + "\n"


async def test_saving_a_big_state_lets_the_event_loop_run_between_parts(tmp_path):
    """A 10,000-server state is filtered in parts with the event loop's other tasks in between
    (control: filtered in one go, the ticker does not move until the file is written)."""
    servers = 10_000
    config = Config.parse("backend app\n" + "".join(f"    server s{i} 127.0.0.1:{i + 1}\n" for i in range(servers)))
    saved = state(*(row(f"s{i}", "127.0.0.1", i + 1) for i in range(servers)))

    class Answers:
        async def on(self, pid: int, command: str, timeout: float | None = None) -> str:
            return saved

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    path = tmp_path / "server-state"
    assert await save_server_state(Answers(), 1, path, running=config, new=config)  # type: ignore[arg-type]
    during = ticks - before
    task.cancel()
    assert len(kept(path.read_text())) == servers
    assert during >= 4, during
