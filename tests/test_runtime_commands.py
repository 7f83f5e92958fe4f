"""Runtime changes: the order of the commands for each change (pure), and reading HAProxy's
answers to them."""

from __future__ import annotations

import itertools

import pytest

from rigs.wholes import to_endpoint
from supervisor.haproxy.runtime.apply import refusal
from supervisor.haproxy.runtime.plan import ServerChange, ordered_commands
from tests.conftest import CORPUS

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
    assert not states["slot1"].in_maint and states["slot1"].op_state != 0
    assert states["slot2"].in_maint and states["s1"].in_maint
