"""Observe mark-down injection on the corpus, and `haproxy -c` on every injected config."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

from bench.config_parse import synthetic_config
from bench.displaced_push import rendered
from supervisor.effective import build_effective, effective_config_and_table, name_rendered_lines, source_lines
from supervisor.haproxy.config import Config, inject_observe, observe_directive
from supervisor.settings import HAProxySettings, ObserveSettings, OldWorkerSettings, ReloadSettings, Settings
from tests.conftest import CORPUS, corpus_files
from tests.support.reference_build import reference_effective

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
        assert effective_config_and_table(Config.parse(text), settings)[0].render() == text


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
    def words(config: Config) -> list[tuple[str, str, list[tuple[str, ...]]]]:
        return [(s.kind, s.name, [line.words for line in filter(None, (s.header, *s.body))]) for s in config.sections]

    assert words(effective.effective_model) == words(reparsed)
    assert effective.effective_model.server_map() == reparsed.server_map()


# observe, preserve_server_state, guard: every injection on and off.
SWITCHES = list(itertools.product([False, True], repeat=3))


def switched(runtime_dir: Path, observe: bool, state: bool, guard: bool) -> Settings:
    return Settings(
        haproxy=HAProxySettings(runtime_dir=runtime_dir),
        observe=ObserveSettings(enabled=observe),
        reload=ReloadSettings(preserve_server_state=state),
        old_workers=OldWorkerSettings(guard=guard),
    )


def assert_builds_like_the_reference(settings: Settings, text: str) -> None:
    expected_text, expected_model = reference_effective(text, settings)
    effective = build_effective(settings, text)
    assert effective.text == expected_text
    assert effective.effective_model.render() == expected_text
    assert Config.parse(effective.rendered_text).render() == text
    assert line_fields(effective.effective_model) == line_fields(expected_model)


def line_fields(config: Config) -> list[tuple[str, str, list[tuple[str, tuple[str, ...], int]]]]:
    return [
        (s.kind, s.name, [(line.raw, line.words, line.code_end) for line in filter(None, (s.header, *s.body))])
        for s in config.sections
    ]


BENCH_SHAPES = {"displaced_push": rendered(300, 18080, {(1, 0): 1, (7, 3): 2}), "config_parse": synthetic_config(300)}


def switches_id(switches: tuple[bool, bool, bool]) -> str:
    return "-".join(name for name, on in zip(("observe", "state", "guard"), switches, strict=True) if on) or "none"


@pytest.mark.parametrize("switches", SWITCHES, ids=switches_id)
@pytest.mark.parametrize("name", [p.name for p in corpus_files()] + list(BENCH_SHAPES))
def test_effective_text_is_byte_identical_to_the_straightforward_build(name, switches, tmp_path):
    """Every corpus file, as written, with CRLF endings and without a final newline; built twice
    each, because the second build runs from the caches the first one filled."""
    settings = switched(tmp_path, *switches)
    text = BENCH_SHAPES[name] if name in BENCH_SHAPES else (CORPUS / name).read_text()
    for variant in (text, text.replace("\n", "\r\n"), text.rstrip("\n")):
        for _ in range(2):
            assert_builds_like_the_reference(settings, variant)


def test_an_edited_section_is_built_anew_not_from_a_stale_cache(tmp_path):
    settings = switched(tmp_path, observe=True, state=True, guard=True)
    base = (
        "defaults\n  mode http\n  default-server inter 1s check\n"
        "backend a\n  server a1 127.0.0.1:1\n  server fb 127.0.0.1:9 backup\n"
        "backend b\n  server b1 127.0.0.1:2\n"
    )
    edits = [
        base,
        # a server line edited: `a` is left with its backup only, so it gets no guard
        base.replace("server a1 127.0.0.1:1\n", "server a1 127.0.0.1:1 backup\n"),
        base,
        # a default-server line in the defaults edited: every server becomes a backup
        base.replace("default-server inter 1s check", "default-server inter 1s check backup"),
        # and one that takes `check` away: no server wants observe any more
        base.replace("default-server inter 1s check", "default-server inter 1s"),
        base,
    ]
    texts = []
    for text in edits:
        assert_builds_like_the_reference(settings, text)
        texts.append(build_effective(settings, text).text)
    guarded = [t.count("# haproxy-supervisor guard") for t in texts]
    observed = [t.count("observe layer4") for t in texts]
    assert guarded == [2, 1, 2, 0, 2, 2]
    assert observed == [2, 1, 2, 0, 0, 2]


def test_guard_plans_kept_from_earlier_builds_give_what_a_cold_build_gives(tmp_path: Path):
    """The guard's placement and slot rows are kept per backend body (with its mode and its
    defaults' flags) from one build to the next. Over corpus configs and random edits of
    them (rule lines, `mode`, a backup, `default-server backup`, a line dropped or doubled),
    a build that finds them kept gives the same effective config and slot table as one that
    starts cold, even where the edit sits in a section the last build had planned."""
    import random

    from supervisor.haproxy.lexer import ConfigCache
    from supervisor.settings import HAProxySettings, Settings

    settings = Settings(haproxy=HAProxySettings(runtime_dir=tmp_path))
    rng = random.Random(7)
    corpus = [p.read_text() for p in sorted((Path(__file__).parent / "corpus").glob("*.cfg"))]
    edits = [
        "    http-request deny if { path /x }\n", "    use-server s1 if { path /y }\n", "    # note\n",
        "    tcp-request content accept\n", "    mode tcp\n", "    mode http\n",
        "    server extra 10.1.1.1:80 backup\n", "    default-server backup\n",
    ]
    checked = 0
    kept = ConfigCache()
    for text in corpus:
        lines = text.splitlines(keepends=True)
        for _ in range(20):
            edited = list(lines)
            i = rng.randrange(1, len(edited))
            choice = rng.random()
            if choice < 0.3:
                del edited[i]
            elif choice < 0.8:
                edited.insert(i, rng.choice(edits))
            else:
                edited.insert(i, edited[i])
            variant = "".join(edited)
            try:
                build_effective(settings, text, kept)  # plans of the unedited config are kept
                warm = build_effective(settings, variant, kept)
            except Exception:
                continue  # an edit our parser refuses is no case for this test
            cold = build_effective(settings, variant, ConfigCache())
            assert warm.text == cold.text
            assert warm.slot_table == cold.slot_table
            checked += 1
    assert checked > 80, checked
    # The same body under another inherited mode: its rules go elsewhere.
    body = "backend b\n    tcp-request content accept\n    http-request deny if { path /x }\n"
    body += "    server s1 10.0.0.1:80\n"
    texts = [f"defaults\n    mode {mode}\n{body}" for mode in ("http", "tcp")]
    build_effective(settings, texts[0], kept)
    warm = build_effective(settings, texts[1], kept)
    assert warm.text == build_effective(settings, texts[1], ConfigCache()).text


def test_every_effective_line_maps_back_to_the_rendered_line_it_comes_from(tmp_path):
    """The injections (global policy, observe, server state, guard) add and edit lines: each
    effective line's source is the rendered line with the same words it started from."""
    text = (CORPUS / "rayserve.cfg").read_text()
    settings = Settings(
        haproxy=HAProxySettings(runtime_dir=tmp_path, move_stats_socket=True),
        observe=ObserveSettings(enabled=True),
        old_workers=OldWorkerSettings(guard=True),
        reload=ReloadSettings(preserve_server_state=True),
    )
    effective = build_effective(settings, text)
    rendered_lines, effective_lines = text.splitlines(), effective.text.splitlines()
    assert len(effective_lines) > len(rendered_lines)  # lines were added, so numbers differ
    sources = source_lines(text, effective.text)
    assert len(sources) == len(effective_lines)
    kept = 0
    for number, line in enumerate(effective_lines, start=1):
        source = rendered_lines[sources[number - 1] - 1]
        if line in rendered_lines:
            assert source == line, (number, line, source)
            kept += 1
        elif line.split()[:2] == source.split()[:2] and line.lstrip().startswith("server "):
            assert line.startswith(source.split("#")[0].rstrip()), (line, source)  # observe appended
    assert kept > len(rendered_lines) * 0.9


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("[ALERT]    (7) : config : parsing [/rd/.validate.1.x.cfg:49] : unknown keyword 'bogus'",
         "[ALERT]    (7) : config : parsing [/etc/h.cfg:36] : unknown keyword 'bogus'"),
        ("[ALERT]    (7) : config : Error(s) found in configuration file : /rd/.validate.1.x.cfg",
         "[ALERT]    (7) : config : Error(s) found in configuration file : /etc/h.cfg"),
        ("[WARNING]  (7) : config : parsing [/rd/.validate.1.x.cfg:999] : past the end",
         "[WARNING]  (7) : config : parsing [/etc/h.cfg:999] : past the end"),
    ],
)
def test_haproxys_messages_name_the_rendered_file_and_line(message: str, expected: str):
    lines = list(range(1, 60))
    lines[48] = 36  # effective line 49 is rendered line 36
    assert name_rendered_lines(message, "/rd/.validate.1.x.cfg", Path("/etc/h.cfg"), lines) == expected
