"""The plan for servers added and removed by name (pure): which changes qualify, the `add
server` line from the resolved settings, and the slot-table commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigs.wholes import plan_runtime_apply
from supervisor.effective import build_effective
from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.plan import loaded_slot_table, resolved_params, runtime_plan, slot_map_commands
from supervisor.settings import HAProxySettings, Settings

RAY = """\
global
    maxconn 1000

defaults base
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
    default-server inter 500ms weight 7

defaults other
    default-server weight 3

frontend fe from base
    bind 127.0.0.1:8000
    default_backend app1

backend app1 from base
    server app1_r1 127.0.0.1:9001 check
    server app1_r2 127.0.0.1:9002 check
    server fallback 127.0.0.1:9100 backup

backend app2 from base
    default-server observe layer4 error-limit 3 on-error mark-down
    server app2_r1 127.0.0.1:9011 check
    server fallback 127.0.0.1:9100 backup
"""


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def plan(old: str, new: str):
    return runtime_plan(Config.parse(old), Config.parse(new))


def test_a_replica_replaced_by_a_new_name_is_one_add_and_one_remove():
    new = edit(RAY, "server app1_r1 127.0.0.1:9001 check", "server app1_r3 127.0.0.1:9003 check")
    p = plan(RAY, new)
    assert p.changes == [] and p.why_reload == ""
    (add,) = p.adds
    (remove,) = p.removes
    assert (add.key, remove) == ("app1/app1_r3", "app1/app1_r1")
    # The defaults' default-server (through `from base`) is carried explicitly.
    assert add.add_command == "add server app1/app1_r3 127.0.0.1:9003 inter 500ms weight 7 check"
    assert add.ready_commands == ["enable health app1/app1_r3", "set server app1/app1_r3 state ready"]
    assert "backup" not in add.params
    # Callers that apply in-place changes only are told a reload is needed.
    assert plan_runtime_apply(Config.parse(RAY), Config.parse(new)) is None


def test_the_backends_own_default_server_lines_and_the_servers_words_resolve_last_wins():
    new = edit(RAY, "    server app2_r1 127.0.0.1:9011 check\n",
               "    server app2_r1 127.0.0.1:9011 check\n    server app2_r2 127.0.0.1:9012 check weight 2\n")
    (add,) = plan(RAY, new).adds
    assert add.add_command == (
        "add server app2/app2_r2 127.0.0.1:9012 inter 500ms observe layer4 error-limit 3 on-error mark-down"
        " check weight 2"
    )


def test_a_backend_without_from_takes_the_last_defaults():
    text = (
        "defaults a\n  default-server weight 9\ndefaults b\n  default-server inter 2s\n"
        "backend x\n  server s1 10.0.0.1:80\n"
    )
    new = text + "  server s2 10.0.0.2:80 backup\n"
    (add,) = plan(text, new).adds
    assert add.add_command == "add server x/s2 10.0.0.2:80 inter 2s backup"
    assert "backup" in add.params and add.ready_commands == ["set server x/s2 state ready"]


def test_a_disabled_server_is_added_and_left_in_maint():
    new = edit(RAY, "    server fallback 127.0.0.1:9100 backup\n\nbackend app2",
               "    server spare 127.0.0.1:9004 check disabled\n"
               "    server fallback 127.0.0.1:9100 backup\n\nbackend app2")
    (add,) = plan(RAY, new).adds
    assert not add.enabled and add.ready_commands == ["enable health app1/spare"]
    assert "disabled" not in add.add_command.split()


@pytest.mark.parametrize(
    ("words", "resolved"),
    [
        (["check", "inter", "1s", "no-check"], ["inter", "1s"]),
        (["no-check"], []),
        (["weight", "7", "check", "weight", "2"], ["check", "weight", "2"]),
        (["disabled", "enabled", "backup"], ["backup"]),
        (["no-sslv3"], ["no-sslv3"]),  # not the negation of a flag: HAProxy judges it
        (["no-backup", "backup"], ["backup"]),
        (["cookie", "x"], ["cookie", "x"]),  # refused by `add server`: the answer decides
    ],
)
def test_resolved_params(words, resolved):
    assert list(resolved_params(words)) == resolved


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        # another line of the backend changes too
        ("    server app1_r1 127.0.0.1:9001 check\n",
         "    retries 2\n    server app1_r3 127.0.0.1:9003 check\n",
         "backend app1: `retries 2` is new"),
        # a server present in both changes beyond address, weight, enabled
        ("server app1_r2 127.0.0.1:9002 check", "server app1_r2 127.0.0.1:9002 check inter 1s",
         "backend app1: `server app1_r2 <address> check inter 1s` differs beyond what the Runtime API sets"),
        # servers reordered
        ("    server app1_r1 127.0.0.1:9001 check\n    server app1_r2 127.0.0.1:9002 check\n",
         "    server app1_r2 127.0.0.1:9002 check\n    server app1_r1 127.0.0.1:9001 check\n",
         "backend app1: its servers are in another order"),
        # a new server at a host name
        ("server app1_r1 127.0.0.1:9001 check", "server app1_r9 replica.local:9001 check",
         "app1/app1_r9: address replica.local:9001 cannot be added at runtime (an IP literal and a port can)"),
        # a default-server line now sits before a kept server
        ("    server app1_r2 127.0.0.1:9002 check\n",
         "    default-server weight 1\n    server app1_r2 127.0.0.1:9002 check\n",
         "backend app1: `default-server weight 1` is new"),
    ],
)
def test_what_still_reloads_says_why_in_one_line(old, new, why):
    p = plan(RAY, edit(RAY, old, new))
    assert p.changes is None and p.why_reload == why


def test_in_place_changes_ride_along():
    new = edit(RAY, "server app1_r1 127.0.0.1:9001 check", "server app1_r3 127.0.0.1:9003 check")
    new = edit(new, "server app1_r2 127.0.0.1:9002 check", "server app1_r2 127.0.0.1:9012 check weight 4")
    p = plan(RAY, new)
    (change,) = p.changes
    assert (change.key, change.to_port, change.to_weight) == ("app1/app1_r2", 9012, 4)
    assert [a.key for a in p.adds] == ["app1/app1_r3"] and list(p.removes) == ["app1/app1_r1"]


def test_effective_configs_with_the_guard_qualify_though_the_slot_table_is_renamed(tmp_path: Path):
    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path))
    before = build_effective(settings, RAY)
    after = build_effective(settings, edit(RAY, "server app1_r1 127.0.0.1:9001", "server app1_r3 127.0.0.1:9003"))
    assert before.slot_table is not None and after.slot_table is not None
    assert before.slot_table.path != after.slot_table.path
    p = runtime_plan(before.effective_model, after.effective_model)
    assert p.why_reload == "" and [a.key for a in p.adds] == ["app1/app1_r3"]


def test_slot_map_commands_make_the_held_table_the_new_configs():
    new = Config.parse(edit(RAY, "    server app1_r1 127.0.0.1:9001 check\n", ""))
    held = {"app1_0": "app1_r1", "app1_1": "app1_r2", "app2_0": "app2_r1"}
    assert slot_map_commands("/run/x/slots-1.map", held, new, {"app1"}) == [
        "set map /run/x/slots-1.map app1_0 app1_r2",
        "del map /run/x/slots-1.map app1_1",
    ]
    grown = Config.parse(edit(RAY, "    server fallback 127.0.0.1:9100 backup\n\nbackend app2",
                              "    server app1_r3 127.0.0.1:9003\n    server fallback 127.0.0.1:9100 backup\n\n"
                              "backend app2"))
    assert slot_map_commands("/m", held, grown, {"app1"}) == ["add map /m app1_2 app1_r3"]
    assert slot_map_commands("/m", held, Config.parse(RAY), {"app1"}) == []


def test_the_loaded_slot_table_is_read_from_show_map():
    answer = (
        "# id (file) description\n"
        "0 (/run/x/steer.map) pattern loaded from file '/run/x/steer.map' used by map at file 'c' line 3.\n"
        "1 (/run/x/slots-0123abcd.map) pattern loaded from file '/run/x/slots-0123abcd.map' used by map at"
        " file 'c' line 4. curr_ver=0 next_ver=0 entry_cnt=3\n"
    )
    assert loaded_slot_table(answer) == "/run/x/slots-0123abcd.map"
    assert loaded_slot_table("# id (file) description\n") is None


def test_slot_map_commands_move_the_cookie_rows_with_their_servers():
    text = (
        "backend b\n    mode http\n    cookie SRV insert\n    server r1 127.0.0.1:9001 cookie c1\n"
        "    server r2 127.0.0.1:9002 cookie c2\n    server r3 127.0.0.1:9003 cookie c3\n"
    )
    held = {"b_0": "r1", "b_1": "r2", "b_2": "r3", "b/cc1": "0", "b/cc2": "1", "b/cc3": "2"}
    assert slot_map_commands("/m", held, Config.parse(text), {"b"}) == []
    # r1 removed at runtime: r2 and r3 move up a slot, and their cookies with them
    removed = Config.parse(text.replace("    server r1 127.0.0.1:9001 cookie c1\n", ""))
    assert slot_map_commands("/m", held, removed, {"b"}) == [
        "set map /m b_0 r2", "set map /m b_1 r3", "set map /m b/cc2 0", "set map /m b/cc3 1",
        "del map /m b_2", "del map /m b/cc1",
    ]
