"""The server keywords that take an argument, held to the binary keyword by keyword.

The model skips a keyword's argument when it reads a server line's flags; a word list kept by
hand drifts (it once held `check-`, `on-` and `send-`, and missed `check-proto`,
`on-marked-down` and `verify`). For every server keyword the binary registers (`haproxy
-dKcfg` lists them), `haproxy -c` runs on a server line with the keyword followed by a probe
word that is no keyword: a flag leaves the probe to be read as a keyword (`unknown keyword
'...'`), a keyword with an argument takes it as its argument. The probe is needed: with
nothing after it, `weight` and `maxconn` pass (an empty value reads as 0), and the flags
`ssl` and `agent-check` fail for reasons of their own.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from supervisor.haproxy.config import Config
from supervisor.haproxy.resolution import SERVER_KEYWORDS_WITH_ARG

pytestmark = pytest.mark.haproxy

PROBE = "zzprobe"
CONFIG = """\
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
frontend f
    bind 127.0.0.1:18999
    default_backend b
backend b
    server s 127.0.0.1:1 {words}
"""

# The list as line wrapping left it (the bug): the control.
WRAPPED_LIST = frozenset(
    """
    addr agent-addr agent-inter agent-port agent-send alpn ca-file check-alpn check-
    proto check-sni ciphers ciphersuites client-sigalgs cookie crl-file crt curves
    downinter error-limit fall fastinter guid hash-key id init-addr inter log-bufsize
    log-proto max-reuse maxconn maxqueue minconn namespace npn observe on-error on-
    marked-down on-marked-up pool-conn-name pool-low-conn pool-max-conn pool-purge-delay
    port proto redir resolve-net resolve-opts resolve-prefer resolvers rise send-
    proxy-v2-options shard sigalgs slowstart sni socks4 source ssl-max-ver ssl-min-ver
    tcp-ut track verifyhost weight ws usesrc interface
    """.split()  # noqa: SIM905 - kept as it was written
)


def binary_server_keywords(haproxy: str) -> list[str]:
    listing = subprocess.run(
        [haproxy, "-dKcfg", "-q", "-c", "-f", "/dev/null"], capture_output=True, text=True, timeout=30
    ).stdout
    return sorted({m.group(1) for m in re.finditer(r"^\s*server <name> <addr> (\S+)", listing, re.M)})


def takes_argument(haproxy: str, directory: Path, keyword: str) -> bool:
    """Does the binary read the word after `keyword` on a server line as its argument?"""
    path = directory / f"{keyword}.cfg"
    path.write_text(CONFIG.format(words=f"{keyword} {PROBE}"))
    result = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    return f"unknown keyword '{PROBE}'" not in result.stdout + result.stderr


@pytest.fixture(scope="module")
def binary_says(haproxy, tmp_path_factory) -> dict[str, bool]:
    """keyword -> takes an argument, for every server keyword of the binary under test."""
    keywords = binary_server_keywords(haproxy)
    if not keywords:
        pytest.skip("this haproxy cannot list its keywords (-dKcfg)")
    directory = tmp_path_factory.mktemp("keywords")
    return {keyword: takes_argument(haproxy, directory, keyword) for keyword in keywords}


def disagreements(binary_says: dict[str, bool], word_list: frozenset[str]) -> dict[str, str]:
    return {
        keyword: "takes an argument, missing from the list" if takes else "is a flag, but listed"
        for keyword, takes in binary_says.items()
        if takes != (keyword in word_list)
    }


def test_the_probe_tells_flags_from_keywords_with_an_argument(binary_says):
    # What the issue saw on 2.6.12, and flags the model acts on.
    assert {k: binary_says[k] for k in ("inter", "check-proto", "verify", "on-marked-down", "weight")} == dict.fromkeys(
        ("inter", "check-proto", "verify", "on-marked-down", "weight"), True
    )
    assert not any(binary_says[k] for k in ("check", "backup", "disabled", "enabled", "no-check", "ssl"))
    assert len(binary_says) > 80


def test_the_list_agrees_with_the_binary_keyword_by_keyword(binary_says):
    assert disagreements(binary_says, SERVER_KEYWORDS_WITH_ARG) == {}


def test_control_the_wrapped_list_disagrees_with_the_binary(binary_says):
    found = disagreements(binary_says, WRAPPED_LIST)
    assert {"check-proto", "on-marked-down", "verify"} <= set(found), found
    # The bogus words are no keyword of the binary at all.
    assert not {"check-", "on-", "send-"} & set(binary_says)


def test_an_argument_is_never_read_as_a_flag():
    """`verify backup`-style lines: the word after a keyword with an argument is that argument."""
    line = "server s 127.0.0.1:1 check-proto h2 on-marked-down shutdown-sessions verify none weight 3 check"
    server = Config.parse(f"backend b\n    {line}\n").server_map()["b/s"]
    assert (server.check, server.weight) == (True, 3)
    tricky = Config.parse("backend b\n    server s 127.0.0.1:1 agent-send backup\n").server_map()["b/s"]
    assert not tricky.backup
