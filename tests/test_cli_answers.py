"""Every command the runtime path sends, read from the answers real binaries gave on `;` lines
(tests/captured/answers_<version>.txt, written by tests/support/capture_answers.py).

Each table row is what a case's commands mean, the same on every version: `ok` (HAProxy did
it), or the refusal in HAProxy's words. The answers differ in shape between versions (2.6.12
ends no `del server` answer with an empty line), never in meaning.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rigs.wholes import filter_server_state
from supervisor.haproxy.answers import (
    parse_prepare_map,
    parse_servers_state,
    parse_show_map,
    split_answers,
)
from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.apply import deleted, refusal
from supervisor.haproxy.runtime.hook import left_pending
from supervisor.haproxy.runtime.plan import loaded_slot_table
from supervisor.steering.live import LiveStates, LiveTally

CAPTURED = Path(__file__).parent / "captured"
VERSIONS = ("2.6.12", "2.8.25", "3.0.11", "3.4.0")
ADDR_INVALID = ("Invalid addr 'foo.example' by 'stats socket command'", "Invalid addr 'foo.example'")

ATTACHED = "Server still has connections attached to it, cannot remove it."
TABLE: dict[str, list[str | tuple[str, ...]]] = {
    "experimental-mode on, then add server": ["ok", "ok"],
    "add server": ["ok"],
    "add server x2": ["ok", "ok"],
    "add server, already there": ["Already exists a server with the same name in backend."],
    "add server, no such backend": ["No such backend."],
    "enable health x2": ["ok", "ok"],
    "enable health, no such server": ["No such server."],
    "enable health, no check configured": ["Health check was not configured on this server, cannot enable."],
    "enable agent x2": ["ok", "ok"],
    "enable agent, no agent configured": ["Agent was not configured on this server, cannot enable."],
    "set server state ready x2": ["ok", "ok"],
    "set server state maint x3": ["ok", "ok", "ok"],
    "set server state, no such server": ["No such server."],
    "set server state, no such backend": ["No such backend."],
    "set server weight x2": ["ok", "ok"],
    "set server weight, out of range": ["Absolute weight can only be between 0 and 256 inclusive."],
    "set server addr port": ["ok"],
    "set server addr, nothing changes": ["ok"],
    "set server addr x2": ["ok", "ok"],
    "set server addr, invalid": [ADDR_INVALID],
    "shutdown sessions server x2": ["ok", "ok"],
    "shutdown sessions server, no such server": ["No such server."],
    "del server, not in maint": ["Only servers in maintenance mode can be deleted."],
    "del server": ["ok"],
    "del server x2": ["ok", "ok"],
    "del server, already deleted": ["No such server."],
    "del server, deleted and gone": ["No such server.", "No such server."],
    "set server state maint, held connection": ["ok"],
    "del server, connection attached": [ATTACHED],
    "del server x2, one attached": ["ok", "ok", ATTACHED],
    "del server, no such backend": ["No such backend."],
    "set server addr, placeholder": ["ok"],
    "add map x2": ["ok", "ok"],
    "set map x2": ["ok", "ok"],
    "set map, no such key": ["entry not found."],
    "del map x2": ["ok", "ok"],
    "del map, no such key": ["Key not found."],
    "mixed: state maint, del server, addr": ["ok", "ok", "ok"],
}


def captured_cases(version: str) -> dict[str, tuple[list[str], str]]:
    """label -> (the line's commands, the answer), from one captured file."""
    cases: dict[str, tuple[list[str], str]] = {}
    label = line = ""
    for row in (CAPTURED / f"answers_{version}.txt").read_text().splitlines():
        if row.startswith("case: "):
            label = row[6:]
        elif row.startswith("line: "):
            line = row[6:]
        elif row.startswith("answer: "):
            cases[label] = (line.split(";"), ast.literal_eval(row[8:]))
    return cases


def meaning(command: str, answer: str) -> str:
    return "ok" if refusal(command, answer) is None else answer.strip()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("label", sorted(TABLE))
def test_every_answer_reads_the_same_on_every_version(version, label):
    commands, text = captured_cases(version)[label]
    answers = split_answers(text, commands)
    assert answers is not None, f"{version}: cannot read {text!r}"
    got = [meaning(c, a) for c, a in zip(commands, answers, strict=True)]
    want = [w if isinstance(w, str) else next((x for x in w if x in got), w[0]) for w in TABLE[label]]
    assert got == want


@pytest.mark.parametrize("version", VERSIONS)
def test_every_captured_case_is_in_the_table(version):
    listings = {"show map", "show map file", "show map file, after", "unknown pid", "show servers state",
                "show servers state b", "show servers state, no such backend"}
    assert set(captured_cases(version)) == set(TABLE) | listings


@pytest.mark.parametrize("version", VERSIONS)
def test_listings(version):
    cases = captured_cases(version)
    (after,) = split_answers(cases["show map file, after"][1], cases["show map file, after"][0])
    assert parse_show_map(after) == [("b_0", "n2"), ("b_1", "n3")]
    (empty,) = split_answers(cases["show map file"][1], cases["show map file"][0])
    assert parse_show_map(empty) == []
    (listed,) = split_answers(cases["show map"][1], cases["show map"][0])
    assert "(<slots>) pattern loaded from file" in listed
    table = "/run/hs/slots-0123456789abcdef.map"  # the capture scrubbed its path
    assert loaded_slot_table(listed.replace("<slots>", table)) == table
    assert loaded_slot_table(listed.replace("<slots>", "/run/hs/steer.map")) is None


def test_prepare_map_answers_its_version_or_an_error():
    assert parse_prepare_map("New version created: 3\n\n") == 3
    assert parse_prepare_map("Unknown map identifier. Please use #<id> or <file>.\n") is None


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("label", ["show servers state", "show servers state b"])
def test_servers_state(version, label):
    # `held` was refused `del server` (a connection attached) and moved to the placeholder.
    commands, text = captured_cases(version)[label]
    (answer,) = split_answers(text, commands)
    states = {s.key: s for s in parse_servers_state(answer)}
    assert sorted(states) == ["b/held", "b/n0", "b/n1", "b/n2", "b/n3", "b/s4", "b/s6"]
    held = states["b/held"]
    assert (held.address, held.port, held.in_maint) == ("127.0.0.1", 1, True)
    assert not states["b/s4"].in_maint and states["b/s4"].weight == 3
    # The config the capture began with, less the servers deleted since: `held` is no longer
    # in it, so a restarted daemon finds it pending.
    kept = ("s4", "s6", "n0", "n1", "n2", "n3")
    config = Config.parse("backend b\n" + "".join(f"    server {n} 127.0.0.1:1\n" for n in kept))
    assert left_pending(states.values(), config) == ["b/held"]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_reader_of_servers_state_reads_the_same_servers(version):
    """The runtime path (parse_servers_state), the steering (LiveTally) and the state handed
    to the next worker (server_state_parts) read one answer through one parser: the same
    servers, on every version, and a row cut short (an answer that ends mid-row) is a
    server to none of them. Control: before they shared it, the hand-over padded a short
    row and kept it, which the other two dropped."""
    commands, text = captured_cases(version)["show servers state"]
    (answer,) = split_answers(text, commands)
    answer = answer.replace("<port>", "8080") + "\n"  # the capture scrubbed its ports
    cut = answer.rstrip("\n").rsplit(" ", 6)[0] + "\n"  # its last row without its last columns
    servers = parse_servers_state(answer)
    assert len(servers) == 7
    # A config that gives each server the address and port it has: every one is handed over.
    config = Config.parse("backend b\n" + "".join(f"    server {s.name} {s.address}:{s.port}\n" for s in servers))
    for text, count in ((answer, 7), (cut, 6)):
        parsed = sorted(s.key for s in parse_servers_state(text))
        tally = LiveTally()
        tally.add(text.replace(" 127.0.0.1 2 ", " 127.0.0.1 0 "))  # every server DOWN: each one noted
        handed = filter_server_state(text, config, config).splitlines()[2:]
        assert len(parsed) == count
        assert sorted(tally.result().alive_by_key) == parsed
        assert sorted(f"b/{line.split()[3]}" for line in handed) == parsed
        again = LiveTally()
        again.add(text.replace(" 127.0.0.1 2 ", " 127.0.0.1 0 "))
        first = tally.result()
        assert again.result(first) is first  # the same states: the last read's objects kept
        assert LiveTally().result(first) == LiveStates()  # other states: a new value


@pytest.mark.parametrize("version", VERSIONS)
def test_servers_state_of_no_such_backend(version):
    commands, text = captured_cases(version)["show servers state, no such backend"]
    (answer,) = split_answers(text, commands)
    assert answer == "Can't find backend." and parse_servers_state(answer) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_a_master_error_ends_the_line_early(version):
    commands, text = captured_cases(version)["unknown pid"]
    assert split_answers(text, commands) == ["Can't find the target PID matching the prefix '@!999999'"]
    # Cut short, the text no longer reads as the answers of a longer line.
    assert split_answers(text, ["@!999999 set server b/s state maint"] * 3) is None
    assert split_answers(text, ["@!999999 del server b/s"] * 2) is None


def test_2_6_del_server_answers_cannot_be_told_apart_by_empty_lines():
    # Control: the reading this module replaced split answers at empty lines; on 2.6.12 the two
    # `del server` answers of one line carry none, so that reading found one answer for two.
    commands, text = captured_cases("2.6.12")["del server x2"]
    assert [a for a in text.split("\n\n") if a] == ["Server deleted.\nServer deleted.\n"]
    assert split_answers(text, commands) == ["Server deleted.", "Server deleted."]


def test_del_server_then_state_reads_one_way_only():
    # `del server` may or may not end with an empty line, `set server ... state` prints one:
    # "Server deleted.\n\n\n" reads one way only, and so does 2.6's "Server deleted.\n\n".
    pair = ["@!1 del server b/s", "@!1 set server b/t state maint"]
    assert split_answers("Server deleted.\n\n\n", pair) == ["Server deleted.", ""]
    assert split_answers("Server deleted.\n\n", pair) == ["Server deleted.", ""]
    assert split_answers("Server deleted.\n", pair) is None


def test_no_such_server_counts_as_deleted_only_once_asked():
    command = "@!1 del server b/s"
    assert deleted(command, "Server deleted.", asked_before=False)
    assert deleted(command, "No such server.", asked_before=True)
    assert not deleted(command, "No such server.", asked_before=False)
    assert not deleted(command, ATTACHED, asked_before=True)
    assert not deleted(command, None, asked_before=True)
