"""ServerKey: the one form of `<backend>/<server>`, and the checks on names that reach the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from supervisor.haproxy.answers import ServerKey, parse_servers_state, validate_name
from supervisor.haproxy.config import Config
from supervisor.haproxy.stderr import parse_server_event

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("app/s1", ("app", "s1")),
        ("be.v2/srv-1:80", ("be.v2", "srv-1:80")),
        ("app", "expected backend/server"),
        ("/s1", "invalid backend name ''"),
        ("app/", "invalid server name ''"),
        ("app/s1/x", "invalid server name 's1/x'"),
        ("app/s1;del server app/s2", "invalid server name"),
        ("app/s1\n", "invalid server name"),
        ("app b/s1", "invalid backend name"),
    ],
)
def test_a_key_parses_into_checked_names_or_says_what_is_wrong(text: str, parsed: tuple[str, str] | str):
    if isinstance(parsed, tuple):
        key = ServerKey.parse(text)
        assert (key.backend, key.server) == parsed and key == text
        assert ServerKey.checked(*parsed) == key == ServerKey.of(*parsed)
    else:
        with pytest.raises(ValueError, match=parsed.replace("'", "'")):
            ServerKey.parse(text)


def test_a_key_is_its_text_form_in_sets_and_maps():
    key = ServerKey.of("app", "s1")
    assert key == "app/s1" and hash(key) == hash("app/s1")
    assert key in {"app/s1"} and {"app/s1": 1}[key] == 1
    assert str(key) == "app/s1" and f"{key}" == "app/s1"


def test_every_reader_names_a_server_with_the_same_key():
    config = Config.parse("backend app\n    server s1 127.0.0.1:80\n")
    (server,) = config.servers()
    header = "# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_port"
    (state,) = parse_servers_state(f"1\n{header}\n3 app 1 s1 127.0.0.1 2 0 1 80\n")
    event = parse_server_event("[WARNING]  (12) : Server app/s1 is DOWN, reason: Layer4 connection problem.")
    assert event is not None
    keys = [server.key, state.key, event.key]
    assert all(type(k) is ServerKey for k in keys) and set(keys) == {"app/s1"}


def test_names_that_could_smuggle_a_command_never_reach_the_cli():
    for bad in ("a;b", "a b", "a\nb", "a/b", "", "a#b"):
        with pytest.raises(ValueError):
            validate_name("server", bad)


def test_no_module_builds_a_server_key_by_hand():
    """Control: before ServerKey, `f"{backend}/{server}"` was written out in fifteen places."""
    built: list[str] = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        tree = ast.parse(path.read_text())
        own = {id(node) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "ServerKey"
               for node in ast.walk(c)}  # fmt: skip
        for node in ast.walk(tree):
            if not isinstance(node, ast.JoinedStr) or id(node) in own:
                continue
            parts = node.values
            values = [isinstance(part, ast.FormattedValue) for part in parts]
            if values == [True, False, True] and getattr(parts[1], "value", None) == "/":
                built.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert built == []
