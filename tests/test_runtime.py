"""Runtime changes: command order, the reloadless plan, and reading HAProxy's answers (pure)."""

from __future__ import annotations

import itertools
import random

import pytest

from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.apply import apply_changes, refusal
from supervisor.haproxy.runtime.changes import ServerChange, ordered_commands
from supervisor.haproxy.runtime.plan import config_skeleton, runtime_plan
from tests.conftest import CORPUS
from tests.support.wholes import plan_runtime_apply, to_endpoint

INGRESS = (CORPUS / "ingress.cfg").read_text()


def change(**overrides) -> ServerChange:
    fields = dict(
        backend="app",
        server="slot1",
        from_address="127.0.0.1",
        from_port=8080,
        to_address="127.0.0.1",
        to_port=8080,
        from_weight=1,
        to_weight=1,
        was_enabled=True,
        enabled=True,
    )
    fields.update(overrides)
    return ServerChange(**fields)


# ---------------------------------------------------------------- ordered_commands


def test_disable_is_maint_first_then_address():
    commands = ordered_commands(change(to_port=1, enabled=False))
    assert commands == ["set server app/slot1 state maint", "set server app/slot1 addr 127.0.0.1 port 1"]


def test_enable_is_address_first_then_ready():
    commands = ordered_commands(change(from_port=1, to_port=9000, was_enabled=False))
    assert commands == [
        "set server app/slot1 state maint",
        "set server app/slot1 addr 127.0.0.1 port 9000",
        "set server app/slot1 state ready",
    ]


def test_new_address_of_live_server_is_swapped_in_place():
    """Never out of rotation (make before break), never at a placeholder."""
    assert ordered_commands(change(to_address="10.0.0.7", to_port=80)) == ["set server app/slot1 addr 10.0.0.7 port 80"]
    assert ordered_commands(change(to_port=81, to_weight=5)) == [
        "set server app/slot1 addr 127.0.0.1 port 81",
        "set server app/slot1 weight 5",
    ]


def test_weight_is_set_inside_the_maint_window():
    commands = ordered_commands(change(from_port=1, to_port=9000, was_enabled=False, to_weight=50))
    assert commands == [
        "set server app/slot1 state maint",
        "set server app/slot1 addr 127.0.0.1 port 9000",
        "set server app/slot1 weight 50",
        "set server app/slot1 state ready",
    ]
    assert ordered_commands(change(to_port=1, enabled=False, to_weight=0)) == [
        "set server app/slot1 state maint",
        "set server app/slot1 addr 127.0.0.1 port 1",
        "set server app/slot1 weight 0",
    ]


def test_weight_alone_is_one_command():
    assert ordered_commands(change(to_weight=7)) == ["set server app/slot1 weight 7"]
    assert ordered_commands(change(to_weight=7, was_enabled=False, enabled=False)) == ["set server app/slot1 weight 7"]


def test_enable_in_place_is_weight_then_ready():
    assert ordered_commands(change(was_enabled=False)) == ["set server app/slot1 state ready"]
    assert ordered_commands(change(was_enabled=False, to_weight=3)) == [
        "set server app/slot1 weight 3",
        "set server app/slot1 state ready",
    ]


def test_disable_in_place_is_maint_alone():
    assert ordered_commands(change(enabled=False)) == ["set server app/slot1 state maint"]


def test_parked_server_readdressed_stays_in_maint():
    commands = ordered_commands(change(to_port=9, was_enabled=False, enabled=False))
    assert commands == ["set server app/slot1 state maint", "set server app/slot1 addr 127.0.0.1 port 9"]


def test_no_change_no_command():
    assert ordered_commands(change()) == []


def test_ipv6_and_portless_addresses():
    assert ordered_commands(change(to_address="::1", to_port=8081)) == ["set server app/slot1 addr ::1 port 8081"]
    portless = change(from_port=None, to_port=None, to_address="127.0.0.2")
    assert ordered_commands(portless) == ["set server app/slot1 addr 127.0.0.2"]


@pytest.mark.parametrize(
    ("was_enabled", "enabled", "readdress", "reweight"),
    list(itertools.product([True, False], repeat=4)),
)
def test_order_invariants(was_enabled, enabled, readdress, reweight):
    c = change(
        was_enabled=was_enabled,
        enabled=enabled,
        to_port=9999 if readdress else 8080,
        to_weight=9 if reweight else 1,
    )
    commands = ordered_commands(c)
    kinds = [cmd.split()[3] for cmd in commands]  # state | addr | weight
    states = [cmd.split()[-1] for cmd in commands if cmd.split()[3] == "state"]
    # Ready comes last, and only for a server that was out and ends in service.
    assert ("ready" in states) == (enabled and not was_enabled)
    if "ready" in states:
        assert commands[-1].endswith("state ready")
    # A server in service at both ends never leaves it: its new address is swapped in place.
    if was_enabled and enabled:
        assert "maint" not in states
    # Nothing is ever ready at an address before the address is set: addr precedes ready,
    # and any other address change happens inside maint.
    elif readdress:
        assert kinds.index("addr") > 0 and commands[0].endswith("state maint")
    # A server that ends disabled is put in maint before anything else.
    if was_enabled and not enabled:
        assert commands[0].endswith("state maint") and "ready" not in states
    assert ("weight" in kinds) == reweight
    assert len(commands) == len(set(commands))


@pytest.mark.parametrize(
    "overrides",
    [
        {"backend": "app;show info"},
        {"server": "slot1 state ready"},
        {"server": "slot\n1"},
        {"backend": ""},
        {"to_address": "127.0.0.1;@!1 shutdown"},
        {"to_address": "10.0.0.1 port 1"},
        {"to_address": "-bad.example"},
        {"to_port": 0},
        {"to_port": 70000},
        {"to_port": "80"},
        {"to_weight": 257},
        {"to_weight": -1},
        {"to_weight": True},
        {"from_port": 80, "to_port": None, "to_address": "10.0.0.2"},
    ],
)
def test_invalid_changes_are_refused(overrides):
    with pytest.raises(ValueError):
        change(**overrides)


def test_host_names_are_valid_addresses():
    assert to_endpoint(change(to_address="pod-1.default.svc.cluster.local")) == "pod-1.default.svc.cluster.local:8080"
    assert to_endpoint(change(to_address="::1", to_port=1)) == "[::1]:1"


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
        # template slots added (servers added or removed by name: tests/test_membership.py)
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


# ---------------------------------------------------------------- answers (2.6.12; whole lines: test_cli_answers)


@pytest.mark.parametrize(
    ("command", "answer", "accepted"),
    [
        ("set server b/s state maint", "", True),
        ("set server b/s state ready", "", True),
        ("set server b/s weight 3", "", True),
        ("set server b/s state maint", "No such server.", False),
        ("set server b/s state maint", "No such backend.", False),
        ("set server b/s state maint", "Proxy is disabled.", False),
        ("set server b/s weight 300", "Absolute weight can only be between 0 and 256 inclusive.", False),
        ("set server b/s weight 50", "Backend is using a static LB algorithm and only accepts weights '0%' and '100%'.",
         False),
        ("set server b/s addr 127.0.0.2 port 9",
         "IP changed from '127.0.0.1' to '127.0.0.2', port changed from '28012' to '9' by 'stats socket command'",
         True),
        ("set server b/s addr 127.0.0.1 port 1",
         "no need to change the addr, port changed from '28011' to '34463' by 'stats socket command'", True),
        ("set server b/s addr 127.0.0.1 port 1",
         "no need to change the addr, no need to change the port by 'stats socket command'", True),
        ("set server b/s addr 127.0.0.2", "IP changed from '127.0.0.1' to '127.0.0.2' by 'stats socket command'", True),
        # 3.0 and later (seen on 3.0.0, 3.2.0, 3.4.0): each part only when it changed, or `nothing changed`.
        ("set server b/s addr 127.0.0.1 port 23002",
         "port changed from '23001' to '23002' by 'stats socket command'", True),
        ("set server b/s addr 127.0.0.1 port 1", "nothing changed", True),
        ("set server b/s addr 127.0.0.1 port +1",
         "can't change <port> to port map because it is incompatible with current health check port "
         "configuration (use 'port' statement from the 'server' directive).", False),
        ("set server b/s addr foo.example port 1", "Invalid addr 'foo.example' by 'stats socket command'", False),
        ("set server b/s addr 127.0.0.1 port 1", "", False),
        ("set server b/s addr 127.0.0.1 port 1", "No such server.", False),
        ("set server b/s addr 127.0.0.1 port 1", "Proxy is disabled.", False),
        ("set server b/s state maint", None, False),
    ],
)
def test_refusal(command, answer, accepted):
    assert (refusal(command, answer) is None) is accepted


def test_config_disabled_flag_alone_is_not_maint():
    # Captured on 2.6.12: a `disabled` slot is admin 5; after `state ready` it serves with
    # admin 4 (the "config said disabled" flag stays); after `state maint` on a live one, 1.
    from supervisor.haproxy.answers import parse_servers_state

    header = (
        "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
        "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
        "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl "
        "srv_check_port srv_check_addr srv_agent_addr srv_agent_port\n"
    )
    rows = (
        "3 app 3 slot1 127.0.0.1 2 4 5 5 0 1 0 0 8 0 0 0 - 1 - 0 0 - - 0\n"
        "3 app 4 slot2 127.0.0.1 0 5 5 5 75 1 0 0 8 0 0 0 - 1 - 0 0 - - 0\n"
        "3 app 1 s1 127.0.0.1 0 1 1 1 0 1 0 0 0 0 0 0 - 28011 - 0 0 - - 0\n"
    )
    states = {s.name: s for s in parse_servers_state(header + rows + "\n")}
    assert not states["slot1"].in_maint and states["slot1"].alive
    assert states["slot2"].in_maint and states["s1"].in_maint


# ---------------------------------------------------------------- make before break


class AnsweringCLI:
    """Answers every command as HAProxy does when it accepts it; records what was sent, in order.
    `refuse` names commands answered with a refusal instead."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.commands: list[str] = []
        self.refuse = refuse

    async def execute(self, line: str) -> str:
        answers = []
        for command in line.split(";"):
            command = command.split(" ", 1)[1]  # drop the @!<pid> prefix
            self.commands.append(command)
            if command in self.refuse:
                answers.append("No such server.\n\n")
            elif " addr " in command:
                answers.append("no need to change the addr, port changed from '1' to '2' by 'stats socket command'\n\n")
            else:
                answers.append("\n")
        return "".join(answers)


def usable_counts(changes: list[ServerChange], commands: list[str]) -> dict[str, list[int]]:
    """Per backend, how many servers are in service before the first command and after each."""
    enabled = {c.key: c.was_enabled for c in changes}
    counts = {b: [sum(v for k, v in enabled.items() if k.startswith(f"{b}/"))] for b in {c.backend for c in changes}}
    for command in commands:
        key = command.split()[2]
        if command.endswith("state maint"):
            enabled[key] = False
        elif command.endswith("state ready"):
            enabled[key] = True
        backend = key.split("/")[0]
        counts[backend].append(sum(v for k, v in enabled.items() if k.startswith(f"{backend}/")))
    return counts


def random_changes(rng) -> list[ServerChange]:
    changes = []
    for b in range(rng.randrange(1, 3)):
        for s in range(rng.randrange(1, 5)):
            was, now = rng.random() < 0.5, rng.random() < 0.5
            readdress, reweight = rng.random() < 0.6, rng.random() < 0.3
            if not (was != now or readdress or reweight):
                readdress = True
            changes.append(change(
                backend=f"b{b}", server=f"s{s}", was_enabled=was, enabled=now,
                to_port=9000 + s if readdress else 8080, to_weight=7 if reweight else 1,
            ))
    return changes


async def test_a_backend_never_has_fewer_servers_during_a_change_than_at_its_ends():
    rng = random.Random(15)
    for _ in range(500):
        changes = random_changes(rng)
        cli = AnsweringCLI()
        result = await apply_changes(cli, 1, changes, line_limit=200)  # a short limit: several lines a step
        assert result.ok and sorted(c.key for c in result.applied) == sorted(c.key for c in changes)
        for backend, counts in usable_counts(changes, cli.commands).items():
            assert min(counts) >= min(counts[0], counts[-1]), (backend, changes, cli.commands)


async def test_control_step_synchronous_order_empties_the_backend_on_a_hand_over():
    hand_over = [
        change(server="SRV_1", to_port=1, enabled=False),
        change(server="SRV_2", from_port=1, to_port=8081, was_enabled=False),
    ]
    cli = AnsweringCLI()
    assert (await apply_changes(cli, 1, hand_over, phased=False)).ok
    assert min(usable_counts(hand_over, cli.commands)["app"]) == 0
    cli = AnsweringCLI()
    assert (await apply_changes(cli, 1, hand_over)).ok
    assert cli.commands == [
        "set server app/SRV_2 state maint",
        "set server app/SRV_2 addr 127.0.0.1 port 8081",
        "set server app/SRV_2 state ready",
        "set server app/SRV_1 state maint",
        "set server app/SRV_1 addr 127.0.0.1 port 1",
    ]


async def test_a_refused_enable_keeps_its_backends_disables_back():
    changes = [
        change(backend="a", server="in", from_port=1, to_port=8081, was_enabled=False),
        change(backend="a", server="out", to_port=1, enabled=False),
        change(backend="b", server="out", to_port=1, enabled=False),
    ]
    cli = AnsweringCLI(refuse=frozenset({"set server a/in addr 127.0.0.1 port 8081"}))
    result = await apply_changes(cli, 1, changes)
    assert [r.change.key for r in result.refused] == ["a/in"] and result.refused[0].left_in_maint
    assert [c.key for c in result.skipped] == ["a/out"] and not result.ok
    assert [c.key for c in result.applied] == ["b/out"]
    assert not any(c.startswith("set server a/out") for c in cli.commands)
