"""Runtime changes: the reloadless plan (pure), which config changes apply at runtime and why
anything else needs a reload."""

from __future__ import annotations

import pytest

from rigs.wholes import plan_runtime_apply
from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.plan import ServerChange, config_skeleton, ordered_commands, runtime_plan
from tests.test_runtime_commands import INGRESS

# ---------------------------------------------------------------- plan_runtime_apply


def edit(text: str, old: str, new: str, count: int = 1) -> str:
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)


def plan(old_text: str, new_text: str) -> list[ServerChange] | None:
    return plan_runtime_apply(Config.parse(old_text), Config.parse(new_text))


def by_key(changes: list[ServerChange]) -> dict[str, ServerChange]:
    return {c.key: c for c in changes}


def test_identical_configs_need_nothing():
    assert plan(INGRESS, INGRESS) == []


def test_comments_and_spacing_need_nothing():
    changed = edit(INGRESS, "    balance roundrobin\n", "\tbalance   roundrobin   # spread\n", count=2)
    changed = "# regenerated at 12:00\n" + changed + "\n\n"
    assert plan(INGRESS, changed) == []


def test_filling_a_parked_slot_is_an_enable():
    new = edit(INGRESS, "server srv003 127.0.0.1:1 disabled weight 1", "server srv003 127.0.0.1:18122 weight 1")
    (c,) = plan(INGRESS, new)
    assert (c.key, c.was_enabled, c.enabled) == ("default_api_8080/srv003", False, True)
    assert (c.from_port, c.to_port, c.address_changed, c.weight_changed) == (1, 18122, True, False)
    assert ordered_commands(c)[-1] == "set server default_api_8080/srv003 state ready"


def test_emptying_a_slot_is_a_disable():
    new = edit(INGRESS, "server srv002 127.0.0.1:18121 weight 50", "server srv002 127.0.0.1:1 disabled weight 1")
    (c,) = plan(INGRESS, new)
    assert (c.key, c.was_enabled, c.enabled, c.from_weight, c.to_weight) == (
        "default_api_8080/srv002", True, False, 50, 1
    )
    assert ordered_commands(c)[0].endswith("state maint")


def test_weight_change():
    new = edit(INGRESS, "server srv001 127.0.0.1:18120 weight 100", "server srv001 127.0.0.1:18120 weight 10")
    (c,) = plan(INGRESS, new)
    assert ordered_commands(c) == ["set server default_api_8080/srv001 weight 10"]


def test_weight_added_where_default_was_one():
    new = edit(INGRESS, "server SRV_1 127.0.0.1:18130 enabled", "server SRV_1 127.0.0.1:18130 enabled weight 1")
    assert plan(INGRESS, new) == []
    new = edit(INGRESS, "server SRV_1 127.0.0.1:18130 enabled", "server SRV_1 127.0.0.1:18130 weight 4 enabled")
    (c,) = plan(INGRESS, new)
    assert (c.from_weight, c.to_weight) == (1, 4)


def test_enabled_keyword_against_disabled_default_server():
    # `default-server disabled` in default_web_80: dropping `enabled` disables SRV_1.
    new = edit(INGRESS, "server SRV_1 127.0.0.1:18130 enabled", "server SRV_1 127.0.0.1:18130")
    (c,) = plan(INGRESS, new)
    assert (c.key, c.was_enabled, c.enabled, c.address_changed) == ("default_web_80/SRV_1", True, False, False)
    new = edit(INGRESS, "server SRV_3 127.0.0.1:1\n", "server SRV_3 127.0.0.1:18132 enabled\n")
    (c,) = plan(INGRESS, new)
    assert (c.key, c.was_enabled, c.enabled, c.to_port) == ("default_web_80/SRV_3", False, True, 18132)


def test_template_line_address_applies_to_every_slot():
    new = edit(INGRESS, "server-template SRV 1-10 127.0.0.1:18110 disabled", "server-template SRV 1-10 127.0.0.1:18111")
    changes = by_key(plan(INGRESS, new))
    assert sorted(changes) == sorted(f"default_shop_http/SRV{i}" for i in range(1, 11))
    assert all(c.enabled and not c.was_enabled and c.to_port == 18111 for c in changes.values())


def test_template_slots_enabled_in_place():
    slots = "server-template SRV_EXTRA 5-8 127.0.0.1:1"
    new = edit(INGRESS, slots, slots + " enabled")
    changes = by_key(plan(INGRESS, new))
    assert sorted(changes) == [f"default_web_80/SRV_EXTRA{i}" for i in range(5, 9)]
    assert all(ordered_commands(c) == [f"set server {c.key} state ready"] for c in changes.values())


def test_same_endpoint_spelled_differently_needs_nothing():
    new = edit(INGRESS, "server srv001 127.0.0.1:18120", "server srv001 ipv4@127.0.0.1:18120")
    assert plan(INGRESS, new) == []


def test_ipv6_endpoints():
    old = "backend b\n  server s [::1]:80\n"
    (c,) = plan(old, "backend b\n  server s ipv6@::2:81\n")
    assert (c.from_address, c.from_port, c.to_address, c.to_port) == ("::1", 80, "::2", 81)
    (c,) = plan(old, "backend b\n  server s 127.0.0.1:80\n")
    assert ordered_commands(c) == ["set server b/s addr 127.0.0.1 port 80"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # template slots added (servers added or removed by name: tests/test_membership_plan.py)
        ("server-template SRV 1-10 ", "server-template SRV 1-12 "),
        ("server-template SRV_EXTRA 5-8 ", "server-template SRV_EXTRA 5-9 "),
        # other server parameters
        ("server srv001 127.0.0.1:18120 weight 100", "server srv001 127.0.0.1:18120 weight 100 check inter 1s"),
        ("server _default_server_backend 127.0.0.1:18199 no-check", "server _default_server_backend 127.0.0.1:18199"),
        ("server srv_static 127.0.0.1:18142 weight 10", "server srv_static 127.0.0.1:18142 weight 10 backup"),
        # default-server, backend, frontend, global, defaults lines
        ("    default-server disabled\n", "    default-server disabled weight 2\n"),
        ("default-server check inter 2s", "default-server check inter 3s"),
        ("    balance leastconn\n    default-server", "    balance roundrobin\n    default-server"),
        ("maxconn 2048", "maxconn 4096"),
        ("timeout connect 5s", "timeout connect 4s"),
        ("bind 127.0.0.1:18100", "bind 127.0.0.1:18101"),
        ("\nbackend _default_backend\n", "\nbackend _default_backend2\n"),
        ("# TCP passthrough", "backend extra\n    server x 127.0.0.1:1\n# TCP passthrough"),
        # addresses the Runtime API cannot set
        ("server srv001 127.0.0.1:18120", "server srv001 app.example.local:18120"),
        ("server srv001 127.0.0.1:18120", "server srv001 unix@/run/app.sock"),
        ("server srv001 127.0.0.1:18120", "server srv001 127.0.0.1:+1000"),
        ("server srv001 127.0.0.1:18120", "server srv001 127.0.0.1"),
        ("server srv001 127.0.0.1:18120", "server srv001 127.0.0.1:0"),
        ("server srv001 127.0.0.1:18120", "server srv001 ::1:18120"),
        # a weight HAProxy would refuse
        ("server srv001 127.0.0.1:18120 weight 100", "server srv001 127.0.0.1:18120 weight 300"),
    ],
)
def test_anything_else_needs_a_reload(old, new):
    assert plan(INGRESS, edit(INGRESS, old, new)) is None
    why = runtime_plan(Config.parse(INGRESS), Config.parse(edit(INGRESS, old, new))).why_reload
    assert why and "\n" not in why and len(why) < 200, why


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        ("server srv001 127.0.0.1:18120 weight 100", "server srv001 127.0.0.1:18120 weight 100 check",
         "backend default_api_8080: `server srv001 <address> check` differs beyond what the Runtime API sets"),
        ("maxconn 2048", "maxconn 4096", "global: `maxconn 4096` differs beyond what the Runtime API sets"),
        ("server srv001 127.0.0.1:18120", "server srv001 app.example.local:18120",
         "default_api_8080/srv001: address app.example.local:18120 cannot be set at runtime"
         " (an IP literal and a port can)"),
        ("server srv001 127.0.0.1:18120", "server srv001 127.0.0.1",
         "default_api_8080/srv001: a port cannot be added to or dropped from a server at runtime"),
        ("server srv001 127.0.0.1:18120 weight 100", "server srv001 127.0.0.1:18120 weight 300",
         "invalid server weight 300: must be an integer from 0 to 256"),
    ],
)
def test_why_a_reload_is_needed_in_one_line(old, new, why):
    assert runtime_plan(Config.parse(INGRESS), Config.parse(edit(INGRESS, old, new))).why_reload == why


def test_why_names_a_line_that_is_gone():
    text = "backend b\n  server s 127.0.0.1:1\n  retries 2\n"
    plan_ = runtime_plan(Config.parse(text), Config.parse(text.replace("  retries 2\n", "")))
    assert plan_.changes is None and plan_.why_reload == "backend b: `retries 2` is gone"


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        # Ray Serve's render while an app rebuilds lacks one line in the middle of a frontend.
        ("  retries 2\n", "", "backend b: `retries 2` is gone"),
        ("  retries 2\n", "  retries 2\n  option redispatch\n", "backend b: `option redispatch` is new"),
        ("  retries 2\n", "  retries 3\n", "backend b: `retries 3` differs beyond what the Runtime API sets"),
    ],
)
def test_why_names_the_line_that_is_gone_new_or_changed_not_its_neighbour(old, new, why):
    text = "backend b\n  server s 127.0.0.1:1\n  retries 2\n  timeout connect 1s\n  balance roundrobin\n"
    plan_ = runtime_plan(Config.parse(text), Config.parse(text.replace(old, new)))
    assert plan_.changes is None and plan_.why_reload == why


def test_servers_outside_backends_are_not_runtime_servers():
    old = "ring logs\n  format rfc5424\n  server log1 127.0.0.1:514\nbackend b\n  server s 127.0.0.1:1\n"
    assert plan(old, old.replace("127.0.0.1:514", "127.0.0.1:515")) is None


def test_skeleton_ignores_exactly_the_runtime_fields():
    a = Config.parse("backend b\n  server s 10.0.0.1:80 weight 3 check disabled cookie disabled\n")
    b = Config.parse("backend b\n  server s 10.0.0.2:81 check enabled cookie disabled\n")
    assert config_skeleton(a) == config_skeleton(b)
    c = Config.parse("backend b\n  server s 10.0.0.2:81 check enabled cookie enabled\n")
    assert config_skeleton(a) != config_skeleton(c)  # a cookie value is not a runtime field


def test_listen_sections_count_as_backends():
    old = "listen l\n  bind 127.0.0.1:1\n  server a 127.0.0.1:2\n"
    (c,) = plan(old, old.replace("127.0.0.1:2", "127.0.0.1:3 disabled"))
    assert (c.key, c.enabled, c.to_port) == ("l/a", False, 3)
