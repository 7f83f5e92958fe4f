"""Observe mark-down injection on the corpus, and `haproxy -c` on every injected config."""

from __future__ import annotations

import subprocess

import pytest

from supervisor.haproxy.config import Config
from supervisor.haproxy.inject import effective_config, inject_observe, observe_directive
from supervisor.settings import ObserveSettings, OldWorkerSettings, ReloadSettings, Settings
from tests.conftest import CORPUS, corpus_files

DIRECTIVE = observe_directive(3)


def injected(name: str, limit: int = 3) -> Config:
    return Config.parse(inject_observe(Config.parse((CORPUS / name).read_text()), limit).render())


def test_primaries_with_check_get_observe_backups_and_trackers_do_not():
    servers = injected("rayserve.cfg").server_map()
    assert servers["echo/echo_r1"].observe
    assert servers["wide/wide_r3"].observe
    assert servers["grpc_wide/wide_r1"].observe
    assert not servers["echo/fallback"].observe  # backup
    assert not servers["echo_via_router/echo_r1"].observe  # track
    assert not servers["highscale_via_router/fallback"].observe


def test_server_lines_are_edited_in_place():
    text = (CORPUS / "rayserve.cfg").read_text()
    out = inject_observe(Config.parse(text), 4).render()
    changed = [(a, b) for a, b in zip(text.splitlines(), out.splitlines(), strict=True) if a != b]
    assert changed, "no line was injected"
    for before, after in changed:
        assert before.lstrip().startswith("server")
        assert observe_directive(4) in after
        # the original words are all still there, in order, and the comment stays last
        assert after.replace(" " + observe_directive(4), "") == before


def test_default_server_check_and_templates_get_observe():
    servers = injected("ingress.cfg").server_map()
    assert servers["default_api_8080/srv001"].observe  # check from default-server
    templated = [s for s in servers.values() if s.template]
    assert templated and all(s.observe for s in templated if s.check)
    text = inject_observe(Config.parse((CORPUS / "ingress.cfg").read_text()), 3).render()
    template_lines = [line for line in text.splitlines() if line.strip().startswith("server-template")]
    assert template_lines and all(line.count("observe layer4") == 1 for line in template_lines)


def test_servers_without_check_and_already_observed_are_left_alone():
    text = (
        "backend b\n"
        "  server nocheck 127.0.0.1:1\n"
        "  server already 127.0.0.1:2 check observe layer7 error-limit 9 on-error fail-check\n"
        "  server off 127.0.0.1:3 check\n"
        "  server off2 127.0.0.1:4 no-check\n"
    )
    out = inject_observe(Config.parse(text), 3).render()
    lines = out.splitlines()
    assert lines[1] == "  server nocheck 127.0.0.1:1"
    assert lines[2].count("observe") == 1
    assert lines[3] == f"  server off 127.0.0.1:3 check {DIRECTIVE}"
    assert lines[4] == "  server off2 127.0.0.1:4 no-check"


def test_gate_off_changes_nothing():
    settings = Settings(
        observe=ObserveSettings(enabled=False),
        old_workers=OldWorkerSettings(guard=False),
        reload=ReloadSettings(preserve_server_state=False),
    )
    for path in corpus_files():
        text = path.read_text()
        assert effective_config(Config.parse(text), settings).render() == text


def test_error_limit_is_used():
    assert "error-limit 11 on-error mark-down" in inject_observe(
        Config.parse("backend b\n server s 127.0.0.1:1 check\n"), 11
    ).render()


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_injected_corpus_passes_haproxy_check(haproxy, tmp_path, path):
    out = tmp_path / path.name
    out.write_text(inject_observe(Config.parse(path.read_text()), 3).render())
    result = subprocess.run([haproxy, "-c", "-f", str(out)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_effective_model_is_what_parsing_the_effective_text_gives(path, tmp_path):
    """The reloader keeps the injected model instead of re-parsing: it must be the same config."""
    from supervisor.effective import build_effective
    from supervisor.settings import HAProxySettings

    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=tmp_path), observe=ObserveSettings(enabled=True),
    )
    effective = build_effective(settings, path.read_text())
    reparsed = Config.parse(effective.text)
    assert effective.effective_model.render() == effective.text
    assert [(s.kind, s.name, [line.words for line in s.lines()]) for s in effective.effective_model.sections] == [
        (s.kind, s.name, [line.words for line in s.lines()]) for s in reparsed.sections
    ]
    assert effective.effective_model.server_map() == reparsed.server_map()
