"""The displaced-worker guard injection: where its lines go, and `haproxy -c` on every corpus config."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rigs.wholes import guard_block, guarded_backends, inject_guard
from supervisor.effective import effective_config_and_table
from supervisor.haproxy.config import Config
from supervisor.haproxy.guard import GUARD_MARKER, SlotTable, inject_guard_and_table, slot_table, slot_table_text
from supervisor.settings import (
    HAProxySettings,
    ObserveSettings,
    OldWorkerSettings,
    ReloadSettings,
    Settings,
    SettingsError,
)
from tests.conftest import CORPUS, corpus_files

MAP = "/run/hs/steer.map"
TABLE = "/run/hs/slots-0123456789abcdef.map"


def table_of(config: Config, directory: Path) -> SlotTable:
    return inject_guard_and_table(config, MAP, directory)[1]


def guarded(text: str, table: str | Path = TABLE) -> str:
    return inject_guard(Config.parse(text), MAP, table).render()


def body_of(text: str, backend: str) -> list[str]:
    section = next((s for s in Config.parse(text).backends() if s.name == backend), None)
    assert section is not None
    return [line.raw.rstrip("\n") for line in section.body]


def test_block_shape_http_and_tcp():
    http = guard_block("http", MAP, TABLE, redispatch=False)
    assert http[0] == GUARD_MARKER
    assert guard_block("http", MAP, TABLE) == [GUARD_MARKER, "option redispatch 1", *http[1:]]
    assert http[-1] == "use-server %[var(txn.hsv_srv)] if { var(txn.hsv_srv) -m found }"
    assert all(line.startswith("http-request ") for line in http[1:-1])
    assert f"http-request set-var(txn.hsv_n) be_name,concat(_n),map({MAP},-1)" in http
    assert "http-request return status 503 if { var(txn.hsv_n) -m int 0 }" in http
    tcp = guard_block("tcp", MAP, TABLE, redispatch=False)
    assert all(line.startswith("tcp-request content ") for line in tcp[1:-1])
    assert "tcp-request content reject if { var(txn.hsv_n) -m int 0 }" in tcp
    # the slot table is consulted only for a slot the steer map does not override
    assert http[-4] == (
        f"http-request set-var(txn.hsv_srv) be_name,concat(_,txn.hsv_slot),map({TABLE}) "
        "if { var(txn.hsv_slot) -m found } !{ var(txn.hsv_srv) -m found }"
    )
    # then a hop for the server so chosen replaces it; both variables start unset
    assert http[-3:-1] == [
        f"http-request set-var(txn.hsv_hop) be_name,concat(/,txn.hsv_srv),map({MAP}) "
        "if { var(txn.hsv_n) -m int gt 0 }",
        "http-request set-var(txn.hsv_srv) var(txn.hsv_hop) if { var(txn.hsv_hop) -m found }",
    ]
    assert http[1:3] == ["http-request unset-var(txn.hsv_srv)", "http-request unset-var(txn.hsv_hop)"]


def test_guard_goes_first_in_plain_backend():
    out = guarded("defaults\n  mode http\nbackend b\n  balance roundrobin\n  server s1 127.0.0.1:1\n")
    body = body_of(out, "b")
    block = guard_block("http", MAP, TABLE)
    assert body[: len(block)] == ["  " + line for line in block]
    assert body[len(block) :] == ["  balance roundrobin", "  server s1 127.0.0.1:1"]


def test_guard_precedes_own_rules_and_own_use_server():
    text = (CORPUS / "rayserve.cfg").read_text()
    body = [line.strip() for line in body_of(guarded(text), "highscale_via_router")]
    own_set_var = body.index("http-request set-var(txn.k) rand(16)")
    own_use_server = body.index("use-server highscale_r1 if { var(txn.key) -m str highscale_via_router_0 }")
    ours = body.index(guard_block("http", MAP, TABLE)[-1])
    assert body.index(GUARD_MARKER) < body.index(guard_block("http", MAP, TABLE)[2]) < own_set_var
    # our use-server comes after every request rule (no HAProxy warning) and before the backend's own
    assert own_set_var < ours < own_use_server


def test_tcp_backend_gets_tcp_rules_and_comments_stay_with_their_line():
    text = (CORPUS / "handwritten_tcp.cfg").read_text()
    body = [line.strip() for line in body_of(guarded(text), "be_tcp")]
    assert "tcp-request content reject if { var(txn.hsv_n) -m int 0 }" in body
    assert not any(line.startswith("http-request") for line in body)
    comment = body.index("# pin a connection to a server by a variable (TCP needs tcp-request content)")
    assert body[comment + 1] == "tcp-request content set-var(txn.k) rand(4)"


def test_which_backends_are_guarded():
    text = (CORPUS / "rayserve.cfg").read_text()
    model = inject_guard(Config.parse(text), MAP, TABLE)
    names = guarded_backends(model)
    # backends with primaries, tracking ones included; none for the server-less default backend
    assert {"echo", "echo_via_router", "highscale", "highscale_via_router", "wide", "grpc_echo"} <= names
    assert "default_backend" not in names
    assert "grpc_fallback_backend" in names  # its only server is a primary
    # injecting twice changes nothing
    assert inject_guard(model, MAP, TABLE).render() == model.render()
    # the slot table covers exactly the guarded backends
    assert {backend for backend, _ in slot_table(model)} == names


REDISPATCH_CASES = [
    # (rendered text, {backend: its redispatch lines in the effective config})
    ("backend b\n  server s 127.0.0.1:1\n", {"b": ["option redispatch 1"]}),
    ("listen l\n  bind :1\n  server s 127.0.0.1:1\n", {"l": ["option redispatch 1"]}),
    ("backend b\n  option redispatch\n  server s 127.0.0.1:1\n", {"b": ["option redispatch"]}),
    ("backend b\n  option redispatch 3\n  server s 127.0.0.1:1\n", {"b": ["option redispatch 3"]}),
    ("backend b\n  no option redispatch\n  server s 127.0.0.1:1\n", {"b": ["no option redispatch"]}),
    ("backend b\n  default option redispatch\n  server s 127.0.0.1:1\n", {"b": ["default option redispatch"]}),
    # in the defaults it applies to: nothing added; a later defaults section starts afresh
    ("defaults\n  option redispatch 2\nbackend b\n  server s 127.0.0.1:1\n", {"b": []}),
    ("defaults\n  no option redispatch\nbackend b\n  server s 127.0.0.1:1\n"
     "defaults\n  mode tcp\nbackend c\n  server s 127.0.0.1:1\n", {"b": [], "c": ["option redispatch 1"]}),
    # a named defaults, through `from`
    ("defaults d\n  option redispatch\ndefaults e\n  mode http\nbackend b from d\n  server s 127.0.0.1:1\n"
     "backend c from e\n  server s 127.0.0.1:1\n", {"b": [], "c": ["option redispatch 1"]}),
    ("defaults d\n  option redispatch\ndefaults e from d\n  mode http\nbackend b\n  server s 127.0.0.1:1\n",
     {"b": []}),
    # no guard, no line: a backup-only or server-less backend
    ("backend b\n  server s 127.0.0.1:1 backup\nbackend e\n  mode http\n", {"b": [], "e": []}),
    # a comment naming it says nothing
    ("backend b\n  # option redispatch\n  server s 127.0.0.1:1\n", {"b": ["option redispatch 1"]}),
]


@pytest.mark.parametrize(("text", "expected"), REDISPATCH_CASES)
def test_every_guarded_backend_gets_option_redispatch_1_unless_its_config_says(text, expected):
    out = guarded(text)
    for backend, lines in expected.items():
        found = [line.strip() for line in body_of(out, backend) if "redispatch" in line.split("#")[0].split()]
        assert found == lines, out


def test_backup_only_backend_is_not_guarded():
    out = guarded("backend b\n  server s 127.0.0.1:1 backup\n")
    assert GUARD_MARKER not in out


def test_rest_of_config_is_untouched():
    text = (CORPUS / "rayserve.cfg").read_text()
    out = guarded(text)
    block = set(guard_block("http", MAP, TABLE))
    kept = [line for line in out.splitlines() if line.strip() not in block]
    assert kept == text.splitlines()


def test_unsafe_map_path_is_refused_with_one_line():
    with pytest.raises(ValueError, match=r"map path '/run/my dir,x/steer\.map'"):
        inject_guard(Config.parse("backend b\n  server s 127.0.0.1:1\n"), "/run/my dir,x/steer.map", TABLE)
    # Through the settings it is a settings error: `run` and `check` say so in one line.
    settings = Settings(haproxy=HAProxySettings(runtime_dir=Path("/run/my dir,x")))
    with pytest.raises(SettingsError, match=r"map path '/run/my dir,x/steer\.map'"):
        effective_config_and_table(Config.parse("backend b\n  server s 127.0.0.1:1\n"), settings)[0]


def test_effective_config_applies_guard_only_when_on():
    text = (CORPUS / "rayserve.cfg").read_text()
    # Server-state lines are another injection; switched off here to see the guard alone.
    no_state = ReloadSettings(preserve_server_state=False)
    on = Settings(haproxy=HAProxySettings(runtime_dir=Path("/run/hs")), reload=no_state)
    off = Settings(old_workers=OldWorkerSettings(guard=False), reload=no_state)
    assert effective_config_and_table(Config.parse(text), off)[0].render() == text
    table = table_of(Config.parse(text), Path("/run/hs"))
    assert effective_config_and_table(Config.parse(text), on)[0].render() == guarded(text, table.path)


def test_slot_table_lists_every_primary_in_config_order():
    text = (
        "defaults\n  default-server check\n"
        "backend b\n  server s1 127.0.0.1:1 disabled\n  server bk 127.0.0.1:9 backup\n"
        "  server-template t 2-3 127.0.0.1:2\n  server s0 127.0.0.1:3 weight 0\n"
        "backend only_backups\n  server bk 127.0.0.1:9 backup\n"
    )
    table = slot_table(Config.parse(text))
    assert table == [("b", ["s1", "t2", "t3", "s0"])]
    assert slot_table_text(table) == "b_0 s1\nb_1 t2\nb_2 t3\nb_3 s0\n"


def test_slot_table_file_is_named_by_the_servers_that_exist():
    base = "backend b\n  server s1 10.0.0.1:80\n  server s2 10.0.0.2:80\n"
    run = Path("/run/hs")
    path = table_of(Config.parse(base), run).path
    assert path.parent == run and path.name.startswith("slots-") and path.suffix == ".map"
    # what a runtime apply changes (address, weight, enabled) keeps the table, and its name
    moved = base.replace("10.0.0.1:80", "10.0.0.9:81 weight 0 disabled")
    assert table_of(Config.parse(moved), run) == table_of(Config.parse(base), run)
    # another server set is another file: a config never names a table rewritten for another
    added = base + "  server s3 10.0.0.3:80\n"
    assert table_of(Config.parse(added), run).path != path


def _settings(runtime: Path, observe: bool) -> Settings:
    return Settings(
        haproxy=HAProxySettings(runtime_dir=runtime),
        observe=ObserveSettings(enabled=observe),
        old_workers=OldWorkerSettings(guard=True),
    )


@pytest.mark.parametrize("observe", [False, True], ids=["guard", "guard+observe"])
@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_guarded_corpus_passes_haproxy_check_without_warnings(haproxy, tmp_path, path, observe):
    from supervisor.effective import prepare_runtime_dir, write_slot_table
    from supervisor.haproxy.global_policy import supervised_global

    settings = _settings(tmp_path / "run", observe)
    prepare_runtime_dir(settings)
    out = tmp_path / path.name
    # The global lines the daemon drops first (as build_effective does): 3.3+ warns on `master-worker`.
    rendered, _ = supervised_global(Config.parse(path.read_text()), settings.haproxy.master_socket_path)
    effective, table = effective_config_and_table(rendered, settings)
    write_slot_table(table)
    out.write_text(effective.render())
    assert GUARD_MARKER in out.read_text()
    result = subprocess.run([haproxy, "-c", "-f", str(out)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr, result.stdout + result.stderr
