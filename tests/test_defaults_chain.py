"""What applies to a proxy: `defaults X from Y` chains, named defaults, `from` on proxies and
defaults order, resolved once (Config.resolved) and used by every reader of the model.

The e2e tests against the binary are in tests/test_defaults_chain_e2e.py; here the rules
themselves, one reader at a time, and a random cross-check against a straightforward
implementation of HAProxy's rule (tests/support/reference_build.py).
"""

from __future__ import annotations

import random

import pytest

from rigs.wholes import inject_guard, plan_runtime_apply
from supervisor.effective import effective_config_and_table
from supervisor.haproxy.config import Config, inject_observe
from supervisor.haproxy.guard import slot_table
from supervisor.haproxy.resolution import resolve, section_servers
from supervisor.settings import ObserveSettings, OldWorkerSettings, ReloadSettings, Settings
from supervisor.steering.dead import Sections
from tests.conftest import CORPUS, corpus_files
from tests.support import reference_build as reference

# The example: the mode comes from two defaults up.
CHAIN = """\
defaults common
    mode http
    timeout connect 1s
defaults def_back from common
    timeout server 1s
backend be from def_back
    server s1 127.0.0.1:20002
"""

# `default-server check` two defaults up, the backend inheriting implicitly (the last defaults).
SERVER_CHAIN = """\
defaults base
    mode http
    default-server check
defaults web from base
    timeout connect 1s
backend b
    server s1 127.0.0.1:1
    server s2 127.0.0.1:2 no-check
"""


def settings_of(text: str, name: str):
    config = Config.parse(text)
    section = next((s for s in config.backends() if s.name == name), None)
    assert section is not None
    return reference.settings_of(config, section)


def test_mode_follows_a_from_chain():
    assert settings_of(CHAIN, "be").mode == "http"
    config = Config.parse(CHAIN)
    assert reference.settings_of(config, next(s for s in config.backends() if s.name == "be")).mode == "http"


def test_guard_flavour_follows_the_chain():
    out = inject_guard(Config.parse(CHAIN), "/run/x/steer.map", "/run/x/slots.map").render()
    assert "http-request return status 503" in out and "tcp-request content" not in out


def test_default_server_flags_follow_the_chain_and_observe_is_injected():
    servers = Config.parse(SERVER_CHAIN).server_map()
    assert servers["b/s1"].check and not servers["b/s2"].check
    out = inject_observe(Config.parse(SERVER_CHAIN), 3).render()
    assert "server s1 127.0.0.1:1 observe layer4" in out
    assert "server s2 127.0.0.1:2 no-check\n" in out


def test_a_defaults_section_without_from_starts_from_nothing():
    """HAProxy: `defaults` without `from` does not inherit from the defaults before it."""
    text = (
        "defaults a\n    mode http\n    default-server check backup\n    option allbackups\n"
        "defaults b\n    timeout connect 1s\n"
        "backend x\n    server s 127.0.0.1:1\n"
    )
    st = settings_of(text, "x")
    assert (st.mode, st.all_backups) == ("tcp", False)
    assert not st.server_defaults.check and not st.server_defaults.backup


def test_from_names_a_defaults_section_the_unnamed_one_after_it_does_not_matter():
    text = (
        "defaults web\n    mode http\n    balance leastconn\n"
        "defaults\n    mode tcp\n"
        "backend named from web\n    server s 127.0.0.1:1\n"
        "backend implicit\n    server s 127.0.0.1:1\n"
    )
    assert (settings_of(text, "named").mode, settings_of(text, "named").balance) == ("http", ("leastconn",))
    assert (settings_of(text, "implicit").mode, settings_of(text, "implicit").balance) == ("tcp", ("roundrobin",))


def test_defaults_from_without_a_name_and_the_last_line_wins():
    text = (
        "defaults base\n    mode tcp\n    default-server weight 7\n"
        "defaults from base\n    mode http\n    default-server backup\n"
        "backend b\n    mode tcp\n    mode http\n    server s 127.0.0.1:1\n    server t 127.0.0.1:2 no-backup\n"
    )
    config = Config.parse(text)
    assert reference.settings_of(config, next(s for s in config.backends() if s.name == "b")).mode == "http"
    servers = config.server_map()
    assert (servers["b/s"].backup, servers["b/s"].weight) == (True, 7)
    assert (servers["b/t"].backup, servers["b/t"].weight) == (False, 7)


def test_inherited_backup_is_not_a_slot():
    text = (
        "defaults base\n    mode http\n    default-server backup\n"
        "defaults web from base\n    timeout connect 1s\n"
        "backend b from web\n    server fallback 127.0.0.1:1\n    server r1 127.0.0.1:2 no-backup\n"
    )
    assert slot_table(Config.parse(text)) == [("b", ["r1"])]


def test_allbackups_from_the_chain_and_no_option_in_the_backend():
    text = (
        "defaults base\n    mode http\n    option allbackups\n"
        "defaults web from base\n    timeout connect 1s\n"
        "backend inherits from web\n    server s 127.0.0.1:1\n"
        "backend refuses from web\n    no option allbackups\n    server s 127.0.0.1:1\n"
        "backend plain\n    server s 127.0.0.1:1\n"
    )
    digest = Sections().digest(Config.parse(text))
    assert digest.sections["inherits"].all_backups
    assert not digest.sections["refuses"].all_backups
    # `plain` takes the last defaults (web), which copied base's option.
    assert digest.sections["plain"].all_backups


def test_steering_digest_is_not_shared_across_different_chains():
    """The digest cache is keyed by what applies, not by the immediate defaults' text."""
    body = "    server s1 127.0.0.1:1\n"
    one = "defaults a\n    default-server backup\ndefaults b from a\n    mode http\nbackend x from b\n" + body
    two = "defaults a\n    mode http\ndefaults b from a\n    mode http\nbackend x from b\n" + body
    cache = Sections()
    digests = [cache.digest(Config.parse(text)) for text in (one, two)]
    assert [d.sections["x"].servers[0].backup for d in digests] == [True, False]


def test_runtime_plan_sees_the_inherited_weight():
    head = "defaults base\n    mode http\n    default-server weight 10\ndefaults web from base\n    retries 1\n"
    running = Config.parse(head + "backend b from web\n    server s 127.0.0.1:1\n")
    new = Config.parse(head + "backend b from web\n    server s 127.0.0.1:1 weight 20\n")
    changes = plan_runtime_apply(running, new)
    assert changes is not None and [(c.from_weight, c.to_weight) for c in changes] == [(10, 20)]


def test_server_state_file_reaches_a_backend_through_its_chain():
    settings = Settings(
        observe=ObserveSettings(enabled=False),
        reload=ReloadSettings(preserve_server_state=True),
        old_workers=OldWorkerSettings(guard=False),
    )
    out = Config.parse(effective_config_and_table(Config.parse(CHAIN), settings)[0].render())
    # Both defaults sections load the state; the backend inherits it from def_back.
    loads = [s.kind for s in out.sections if any(line.keyword == "load-server-state-from-file" for line in s.body)]
    assert loads == ["defaults", "defaults"]


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_one_pass_agrees_with_the_straightforward_rule_on_the_corpus(path):
    config = Config.parse(path.read_text())
    proxies = [(s, st) for s, st in resolve(config.sections) if s.kind != "defaults"]
    assert proxies
    for section, settings in proxies:
        assert settings.mode == reference.mode_of(config, section), section.name


def _random_config(rng: random.Random) -> str:
    names: list[str] = []
    out: list[str] = []
    for i in range(rng.randrange(1, 6)):
        kind = rng.choice(["defaults", "defaults", "backend"])
        header = [kind]
        if kind == "defaults":
            if rng.random() < 0.7:
                header.append(f"d{i}")
        else:
            header.append(f"b{i}")
        if names and rng.random() < 0.5:
            header += ["from", rng.choice(names)]
        out.append(" ".join(header))
        if kind == "defaults" and len(header) > 1 and header[1] != "from":
            names.append(header[1])
        for _ in range(rng.randrange(0, 4)):
            out.append(rng.choice([
                "    mode http", "    mode tcp", "    default-server check", "    default-server no-check",
                "    default-server backup", "    default-server no-backup", "    default-server weight 3",
                "    option allbackups", "    no option allbackups", "    balance leastconn",
            ]))
        if kind == "backend":
            out.append(f"    server s{i} 127.0.0.1:{i + 1}")
    return "\n".join(out) + "\n"


def test_random_chains_agree_with_the_straightforward_rule():
    rng = random.Random(17)
    for _ in range(3000):
        text = _random_config(rng)
        config = Config.parse(text)
        for section, settings in config.each_backend_with_settings():
            assert settings.mode == reference.mode_of(config, section), text
            expected = [(f.check, f.backup) for _, f in reference.servers(config, section)]
            assert [(s.check, s.backup) for s in section_servers(section, settings, config.cache)] == expected, text


def test_the_chained_template_corpus_resolves_as_haproxy_reads_it():
    config = Config.parse((CORPUS / "templates_chained.cfg").read_text())
    settings = {s.name: st for s, st in resolve(config.sections) if s.kind != "defaults"}
    assert (settings["edge_http"].mode, settings["edge_http"].balance, settings["edge_http"].all_backups) == (
        "http", ("leastconn",), True
    )
    assert (settings["raw_tcp"].mode, settings["mixed_slots"].all_backups) == ("tcp", False)
    assert (settings["plain_slots"].mode, settings["plain_slots"].server_defaults.check) == ("http", False)
    rows = dict(slot_table(config))
    assert "maintenance_pages" not in rows  # every server a backup through the chain
    assert rows["mixed_slots"] == ["LIVE_1", "LIVE_2", "LIVE_3"]
    assert rows["edge_http"] == [f"APP_{i}" for i in range(1, 7)]
    servers = config.server_map()
    assert servers["raw_tcp/TCP_1"].check and not servers["plain_slots/SLOT_1"].check
    ingress = Config.parse((CORPUS / "ingress_templates.cfg").read_text()).server_map()
    assert (ingress["shop_web_8080/SRV_6"].check, ingress["shop_web_8080/SRV_6"].weight) == (True, 10)
    assert (ingress["db_postgres_5432/SRV_3"].check, ingress["db_postgres_5432/SRV_3"].weight) == (True, None)
    assert not ingress["default_local_service/SRV_1"].check
