"""The controller's lines read as commands, and the safe order: pure, tables."""

from __future__ import annotations

import pytest

from rigs.controller import disable, enable, sync_line
from supervisor.controller.connections import (
    Address,
    Effect,
    address_waits,
    has_payload,
    parse_command,
    parse_line,
    requested_address,
    safe_order,
    service_changes,
    session_prefix,
    split_line,
)


def order_of(line: bytes) -> list[bytes]:
    commands = parse_line(line.rstrip(b"\n"))
    return [commands[i].text for i in safe_order(commands)]


@pytest.mark.parametrize(
    ("line", "commands"),
    [
        (b"show info", [b"show info"]),
        (b"a;b;", [b"a", b"b", b""]),
        (b"set map m k a\\;b;show info", [b"set map m k a\\;b", b"show info"]),
        (b"", [b""]),
    ],
)
def test_split_line(line: bytes, commands: list[bytes]) -> None:
    assert split_line(line) == commands


@pytest.mark.parametrize(
    ("text", "server", "effect"),
    [
        (b"set server b/SRV_3 addr 127.0.0.1 port 1", "b/SRV_3", Effect.ADDRESS),
        (b"set server b/SRV_3 state maint", "b/SRV_3", Effect.OUT_OF_SERVICE),
        (b"set server b/SRV_3 state ready", "b/SRV_3", Effect.IN_SERVICE),
        (b"set server b/SRV_3 state drain", "b/SRV_3", Effect.OTHER),
        (b"disable server b/SRV_3", "b/SRV_3", Effect.OUT_OF_SERVICE),
        (b"enable server b/SRV_3", "b/SRV_3", Effect.IN_SERVICE),
        (b"set server b/SRV_3 health down", "b/SRV_3", Effect.OUT_OF_SERVICE),
        (b"set server b/SRV_3 agent up", "b/SRV_3", Effect.IN_SERVICE),
        (b"set server b/SRV_3 weight 10", "b/SRV_3", Effect.OTHER),
        (b"set severity-output number", None, None),
        (b"show servers state b", None, None),
        (b"set server nobackend state maint", None, Effect.OUT_OF_SERVICE),
    ],
)
def test_parse_command(text: bytes, server: str | None, effect: Effect | None) -> None:
    command = parse_command(text)
    assert (command.server, command.effect) == (server, effect)


PAIR_MAINT = [b"set server b/S3 state maint", b"set server b/S3 addr 127.0.0.1"]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # the controller's disable: maint goes first
        (sync_line(disable("b", "S3")), [b"set severity-output number", *PAIR_MAINT, b""]),
        # with a port, as the issue quotes it
        (sync_line(disable("b", "S3", port=1)),
         [b"set severity-output number", b"set server b/S3 state maint",
          b"set server b/S3 addr 127.0.0.1 port 1", b""]),
        # an enable is already safe: address first, then ready
        (sync_line(enable("b", "S3", "10.0.0.7", 80)),
         [b"set severity-output number", b"set server b/S3 addr 10.0.0.7 port 80",
          b"set server b/S3 state ready", b""]),
        # a rolling step: one slot off, one on; only the disable's pair turns round
        (sync_line(enable("b", "S1", "10.0.0.8", 80), disable("b", "S3")),
         [b"set severity-output number", b"set server b/S1 addr 10.0.0.8 port 80", b"set server b/S1 state ready",
          *PAIR_MAINT, b""]),
        # another server's command between the pair keeps its place after the moved maint
        (b"set server b/S3 addr 127.0.0.1;show info;set server b/S3 state maint\n",
         [b"set server b/S3 state maint", b"set server b/S3 addr 127.0.0.1", b"show info"]),
        # two address changes in a row: maint goes before both
        (b"set server b/S3 addr 10.0.0.1;set server b/S3 addr 127.0.0.1;set server b/S3 state maint\n",
         [b"set server b/S3 state maint", b"set server b/S3 addr 10.0.0.1", b"set server b/S3 addr 127.0.0.1"]),
        # a ready between them: the maint is the operator's later word, it stays after the ready
        (b"set server b/S3 addr 10.0.0.1;set server b/S3 state ready;set server b/S3 state maint\n",
         [b"set server b/S3 addr 10.0.0.1", b"set server b/S3 state ready", b"set server b/S3 state maint"]),
        # another server's maint does not move across S3's address change
        (b"set server b/S3 addr 127.0.0.1;set server b/S4 state maint\n",
         [b"set server b/S3 addr 127.0.0.1", b"set server b/S4 state maint"]),
        # disable server and health down count as out of service
        (b"set server b/S3 addr 127.0.0.1;disable server b/S3\n",
         [b"disable server b/S3", b"set server b/S3 addr 127.0.0.1"]),
        (b"set server b/S3 addr 127.0.0.1;set server b/S3 health down\n",
         [b"set server b/S3 health down", b"set server b/S3 addr 127.0.0.1"]),
        # nothing to do with servers: untouched
        (b"set severity-output number;show info\n", [b"set severity-output number", b"show info"]),
    ],
)
def test_safe_order(line: bytes, expected: list[bytes]) -> None:
    assert order_of(line) == expected


def test_safe_order_is_a_permutation_of_a_long_line() -> None:
    slots = [disable("b", f"SRV_{i}") if i % 2 else enable("b", f"SRV_{i}", "10.0.0.1", 80) for i in range(200)]
    commands = parse_line(sync_line(*slots).rstrip(b"\n"))
    order = safe_order(commands)
    assert sorted(order) == list(range(len(commands)))
    sent = [commands[i] for i in order]
    for i, command in enumerate(sent):
        if command.effect is Effect.ADDRESS and command.text.endswith(b"addr 127.0.0.1"):
            assert sent[i - 1].effect is Effect.OUT_OF_SERVICE and sent[i - 1].server == command.server


def test_service_changes_take_each_server_last_word() -> None:
    line = sync_line(disable("b", "S3"), enable("b", "S1", "10.0.0.8", 80)).rstrip(b"\n")
    assert service_changes(parse_line(line)) == {"b/S3": False, "b/S1": True}
    assert service_changes(parse_line(b"disable server b/S3;enable server b/S3")) == {"b/S3": True}
    assert service_changes(parse_line(b"set server b/S3 weight 0;show info")) == {}


@pytest.mark.parametrize(
    ("line", "count"),
    [(b"set severity-output number;show info", 1), (b"show info", 0),
     (b"set severity-output number;set severity-output none;x", 2)],
)
def test_session_prefix(line: bytes, count: int) -> None:
    assert session_prefix(parse_line(line)) == count


@pytest.mark.parametrize(
    ("line", "expected"),
    [(b"set severity-output number;add map @1 /m.map <<", True), (b"add map @1 /m.map k v", False),
     (b"add map @1 /m.map <<\r", True)],
)
def test_has_payload(line: bytes, expected: bool) -> None:
    assert has_payload(line) is expected


def test_controller_settings_are_off_by_default_and_paths_when_set(tmp_path) -> None:
    from supervisor.settings import SettingsError, load_settings

    assert load_settings(_write(tmp_path, "{}")).controller.runtime_socket is None
    text = "controller:\n  runtime_socket: run/api.sock\n  master_socket: /m.sock\n"
    with pytest.raises(SettingsError, match=r"controller\.runtime_socket needs haproxy\.move_stats_socket: true"):
        load_settings(_write(tmp_path, text))
    settings = load_settings(_write(tmp_path, text + "haproxy:\n  move_stats_socket: true\n"))
    assert settings.controller.runtime_socket == tmp_path / "run/api.sock"
    assert str(settings.controller.master_socket) == "/m.sock"


def _write(directory, text: str):
    path = directory / "settings.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("result", "error", "start", "contains"),
    [
        ("ok", None, b"Success=1\n--\n", b"reloaded"),
        ("runtime_applied", None, b"Success=1\n--\n", b"applied at runtime"),
        ("invalid", "[NOTICE] x\n[ALERT]    (7) : config : parsing [c:3] : unknown keyword 'bogus'", b"Success=0\n--\n",
         b"[ALERT]    (7) : config : parsing"),
        ("invalid", "/etc/haproxy/haproxy.cfg: cannot read rendered config: No such file", b"Success=0\n--\n",
         b"[ALERT]"),
        ("failed", "reload took no effect", b"Success=0\n--\n", b"[ALERT]"),
        ("unknown", "not confirmed", b"Success=0\n--\n", b"reload unknown"),
    ],
)
def test_reload_answer_has_haproxys_shape(result: str, error: str | None, start: bytes, contains: bytes) -> None:
    from supervisor.controller.facade import reload_answer
    from supervisor.state import ReloadRecord, utcnow

    answer = reload_answer(ReloadRecord(utcnow(), result, 1.0, error), 7)  # type: ignore[arg-type]
    assert answer.startswith(start) and contains in answer and answer.endswith(b"\n\n"), answer
    assert reload_answer(None, 7).startswith(b"Success=0\n--\n[ALERT]")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"set server b/S addr 10.0.0.7 port 80", Address("b/S", "10.0.0.7", 80)),
        (b"set server b/S addr 127.0.0.1", Address("b/S", "127.0.0.1", None)),
        (b"set server b/S addr ::1 port 8080", Address("b/S", "::1", 8080)),
        (b"set server b/S addr pod.local port 80", None),  # a name: the state shows its resolution
        (b"set server b/S fqdn pod.local", None),
        (b"set server b/S state ready", None),
    ],
)
def test_requested_address(text: bytes, expected: Address | None) -> None:
    assert requested_address(parse_command(text)) == expected


@pytest.mark.parametrize(
    ("line", "waits"),
    [
        # the controller's enable: the address must show before ready
        (sync_line(enable("b", "S1", "10.0.0.8", 80)), {1: Address("b/S1", "10.0.0.8", 80)}),
        # its disable, in the safe order (maint first): nothing to wait for
        (sync_line(disable("b", "S3", port=1)), {}),
        # a step of a rolling deployment: only the enable waits
        (sync_line(disable("b", "S1", port=1), enable("b", "S2", "10.0.0.8", 80)),
         {3: Address("b/S2", "10.0.0.8", 80)}),
        # another server's command between: still waits for its own ready
        (b"set server b/S1 addr 10.0.0.8;show info;set server b/S1 state ready",
         {0: Address("b/S1", "10.0.0.8", None)}),
        # a weight change after the address: no ready follows, no wait
        (b"set server b/S1 addr 10.0.0.8;set server b/S1 weight 5", {}),
    ],
)
def test_address_waits(line: bytes, waits: dict[int, Address]) -> None:
    commands = parse_line(line.rstrip(b"\n"))
    assert address_waits(commands, safe_order(commands)) == waits
