"""The lexer's blanks are HAProxy's: a server line whose name and address are separated by
one odd character is valid to `haproxy -c` exactly when parse_line finds the address."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rigs.harness import haproxy_binary
from supervisor.haproxy.lexer import parse_line

pytestmark = pytest.mark.haproxy

CONFIG = """\
global
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
backend b
{line}
"""


@pytest.mark.parametrize("between", [" ", "\t", "\v", "\f", "\xa0", "\x1f", "\x1c"])
def test_haproxy_and_the_lexer_split_a_line_at_the_same_characters(tmp_path: Path, between: str):
    line = f"    server s1{between}127.0.0.1:80"
    path = tmp_path / "haproxy.cfg"
    path.write_text(CONFIG.format(line=line))
    checked = subprocess.run([haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    # Valid, or valid but with no listener to start (exit 2); an unsplit line is an ALERT.
    haproxy_splits = "ALERT" not in checked.stdout + checked.stderr
    assert haproxy_splits == (parse_line(line).words == ("server", "s1", "127.0.0.1:80")), checked.stderr
