"""The rendered-config model: parsing, servers, byte-identical render."""

from __future__ import annotations

import random

import pytest

from supervisor.haproxy.config import CHUNKS, SERVER_FLAGS, Config
from supervisor.haproxy.lexer import ConfigCache, content_key, parse_line
from supervisor.haproxy.resolution import SECTION_SERVERS, split_address, template_names
from tests.conftest import corpus_files
from tests.support import reference_build as reference


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_corpus_renders_byte_identical(path):
    text = path.read_text()
    assert Config.parse(text).render() == text


def test_render_keeps_missing_final_newline_and_crlf():
    text = "global\r\n  maxconn 10 # c\r\nbackend b\n  server s 127.0.0.1:1"
    assert Config.parse(text).render() == text


def test_parse_line_quotes_escapes_and_comments():
    line = parse_line("""  http-response set-header X-Note "a # b" 'c d' e\\ f # trailing\n""")
    assert line.words == ("http-response", "set-header", "X-Note", "a # b", "c d", "e f")
    assert line.raw[: line.code_end].endswith("e\\ f")


def test_parse_line_comment_glued_to_word():
    assert parse_line("server s 127.0.0.1:1 weight 10#c\n").words == ("server", "s", "127.0.0.1:1", "weight", "10")


def test_with_appended_goes_before_comment():
    line = parse_line("\tserver s1 127.0.0.1:80 check   # primary\n")
    assert line.with_appended(" observe layer4").raw == "\tserver s1 127.0.0.1:80 check observe layer4   # primary\n"


def test_split_address_forms():
    assert split_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert split_address("[::1]:8080") == ("::1", 8080)
    assert split_address("ipv6@::1:18202") == ("::1", 18202)
    assert split_address("unix@/run/x.sock") == ("unix@/run/x.sock", None)
    assert split_address("backend.svc") == ("backend.svc", None)


def test_template_names():
    assert template_names("SRV", "3") == ["SRV1", "SRV2", "SRV3"]
    assert template_names("s_", "5-7") == ["s_5", "s_6", "s_7"]
    # HAProxy reads counts with atoi() and accepts junk; so must the model, without raising.
    assert template_names("s", "x-y") == []
    assert template_names("s", "2x") == ["s1", "s2"]


def test_rayserve_servers_and_flags():
    config = Config.parse((corpus_files()[0].parent / "rayserve.cfg").read_text())
    servers = config.server_map()
    assert servers["echo/echo_r1"].check and not servers["echo/echo_r1"].backup
    assert servers["echo/fallback"].backup
    assert servers["echo_via_router/echo_r1"].track == "echo/echo_r1"
    wide = [s.name for s in servers.values() if s.backend == "wide" and not s.backup]
    assert wide == ["wide_r1", "wide_r2", "wide_r3"]
    assert "h2" in servers["grpc_wide/wide_r1"].params


def test_default_server_and_templates_in_ingress():
    config = Config.parse((corpus_files()[0].parent / "ingress.cfg").read_text())
    servers = config.server_map()
    # check comes from `default-server` in defaults
    assert servers["default_api_8080/srv001"].check
    assert servers["default_api_8080/srv003"].disabled
    assert servers["default_api_8080/srv003"].endpoint == "127.0.0.1:1"
    templated = [s for s in config.servers() if s.template]
    assert len(templated) >= 5 and all(s.name.startswith("SRV") for s in templated)


def test_default_server_scoping():
    text = (
        "defaults\n  default-server check\n"
        "backend a\n  server a1 127.0.0.1:1\n  server a2 127.0.0.1:2 no-check\n"
        "  default-server backup\n  server a3 127.0.0.1:3\n"
        "defaults named\n  mode http\n"
        "backend b\n  server b1 127.0.0.1:4\n"
    )
    servers = Config.parse(text).server_map()
    assert servers["a/a1"].check and not servers["a/a1"].backup
    assert not servers["a/a2"].check
    assert servers["a/a3"].backup
    # backend b follows the last defaults section, which sets no default-server
    assert not servers["b/b1"].check


def test_named_defaults_with_from():
    text = (
        "defaults base\n  default-server check\n  mode http\n"
        "defaults other\n  mode tcp\n"
        "backend x from base\n  server x1 127.0.0.1:1\n"
        "backend y\n  server y1 127.0.0.1:2\n"
    )
    config = Config.parse(text)
    servers = config.server_map()
    assert servers["x/x1"].check and not servers["y/y1"].check
    x, y = (next(s for s in config.backends() if s.name == name) for name in "xy")
    assert (reference.settings_of(config, x).mode, reference.settings_of(config, y).mode) == ("http", "tcp")


def test_argument_words_are_not_flags():
    servers = Config.parse("backend b\n  server s 127.0.0.1:1 track other/backup observe layer4\n").server_map()
    s = servers["b/s"]
    assert s.track == "other/backup" and not s.backup and s.observe


def test_opaque_sections_survive_copy_and_edit():
    text = "userlist u\n  user a insecure-password x\nbackend b\n  server s 127.0.0.1:1 check\n"
    config = Config.parse(text)
    copy = config.copy()
    section = next((s for s in copy.backends() if s.name == "b"), None)
    section.body[0] = section.body[0].with_appended(" weight 5")
    assert config.render() == text  # the original is untouched
    assert "server s 127.0.0.1:1 check weight 5\n" in copy.render()
    assert copy.render().startswith("userlist u\n  user a insecure-password x\n")


def _line_fields(config: Config) -> list[tuple[str, str, list[tuple[str, tuple[str, ...], int]]]]:
    return [
        (s.kind, s.name, [(line.raw, line.words, line.code_end) for line in filter(None, (s.header, *s.body))])
        for s in config.sections
    ]


def _variants(text: str) -> list[str]:
    """The text as written, with CRLF endings, and without its final newline."""
    return [text, text.replace("\n", "\r\n"), text.rstrip("\n")]


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_parse_gives_the_straightforward_parse_every_time(path):
    """The second parse runs from the line cache: it must give what the first, and the plain tokenizer, give."""
    for text in _variants(path.read_text()):
        expected = _line_fields(reference.parse(text))
        for _ in range(3):
            config = Config.parse(text)
            assert _line_fields(config) == expected
            assert config.render() == text


# Pieces of configs that cut and join in every way the parse must see through: headers
# indented, quoted, escaped, glued to a comment, ending the text, after a lone `\r`.
_PIECES = [
    "global\n  maxconn 10\n", "defaults\n  mode http\n", "defaults named\n", "frontend f\n  bind :80\n",
    "backend a\n  server s 127.0.0.1:1\n", "backend a\n  server s 127.0.0.1:2 backup\n",
    "  backend indented\n  server s 127.0.0.1:3\n", '"backend" quoted\n', "back\\end escaped\n",
    "backend#glued\n", "listen l\r\n  server s 127.0.0.1:4\r\n", "backend lone-cr\r  server x 1.1.1.1:1\r",
    "backends not-a-header\n", "  server orphan 127.0.0.1:5\n", "# a comment\n", "\n", "backend last",
    "resolvers dns\n  nameserver d 127.0.0.1:53\n", "\x0cbackend after-form-feed\n",
]


def test_a_parse_that_reuses_earlier_parses_is_the_straightforward_parse():
    """Config.parse takes runs of lines it parsed before from the cache, whole: configs that
    share some of their runs with the last ones, wherever they sit, still parse as line by line."""
    rng = random.Random(7)
    cache = ConfigCache()
    for _ in range(400):
        cache.new_generation()
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randrange(0, 9)))
        assert _line_fields(Config.parse(text, cache)) == _line_fields(reference.parse(text)), repr(text)
        assert Config.parse(text, cache).render() == text


def test_tokenizer_agrees_with_the_straightforward_one_on_random_lines():
    """Lines as Config.parse cuts them: \r and \n only at the end. With the blanks HAProxy
    takes and does not (\v and \f; \xa0 and \x1f, which Python's str.split() takes)."""
    rng = random.Random(4)
    alphabet = [" ", " ", "\t", "\v", "\f", "\xa0", "\x1f", "#", '"', "'", "\\", "a", "b", "server", ":", "80"]
    for _ in range(5000):
        raw = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 14)))
        raw += rng.choice(["", "\n", "\r\n", "\r"])
        expected = reference.parse_line(raw)
        assert parse_line(raw) == expected, repr(raw)
        assert parse_line(raw) == expected, repr(raw)  # again, from the cache
        text = raw + "\nbackend b\n" + raw
        assert _line_fields(Config.parse(text)) == _line_fields(reference.parse(text)), repr(text)


def test_an_edited_line_is_parsed_anew():
    before = Config.parse("backend b\n  server s 127.0.0.1:1 check\n")
    after = Config.parse("backend b\n  server s 127.0.0.1:1 backup\n")
    assert before.servers()[0].check and not before.servers()[0].backup
    assert after.servers()[0].backup and not after.servers()[0].check


def _flags_from_servers(config: Config) -> list[list[tuple[int, tuple[object, ...]]]]:
    """servers_by_backend(), one entry per server line: what server_flags_by_backend() must say."""
    result = []
    for _, servers in config.servers_by_backend():
        by_line = {s.line_index: (s.check, s.backup, s.disabled, s.observe, s.track, s.weight) for s in servers}
        result.append(sorted(by_line.items()))
    return result


def _flags_by_line(config: Config) -> list[list[tuple[int, tuple[object, ...]]]]:
    return [
        [(i, (f.check, f.backup, f.disabled, f.observe, f.track, f.weight)) for i, f in lines]
        for _, lines in config.server_flags_by_backend()
    ]


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_server_flags_by_line_agree_with_the_servers(path):
    config = Config.parse(path.read_text())
    for _ in range(2):  # the second time from the cache
        assert _flags_by_line(config) == _flags_from_servers(config)


ONE_BODY_UNDER_TWO_DEFAULTS = (
    "defaults plain\n  mode http\n"
    "defaults backups\n  mode http\n  default-server backup\n"
    "backend a from plain\n  server s 127.0.0.1:1 check\n"
    "backend b from backups\n  server s 127.0.0.1:1 check\n"
    "backend c from plain\n  server s 127.0.0.1:1 check\n"
)


def test_same_backend_text_under_other_defaults_gets_their_flags():
    """The flag cache is keyed by the body's text and the defaults' flags: one body, two defaults."""
    text = ONE_BODY_UNDER_TWO_DEFAULTS
    for _ in range(2):
        config = Config.parse(text)
        assert [[f.backup for _, f in lines] for _, lines in config.server_flags_by_backend()] == [
            [False], [True], [False]
        ]
        assert _flags_by_line(config) == _flags_from_servers(config)


def test_same_backend_body_gives_the_servers_of_its_name_and_defaults():
    """Servers are kept by (backend name, defaults, body text): one body in three backends,
    under two defaults, parsed twice (the second time from what the first one made)."""
    text = ONE_BODY_UNDER_TWO_DEFAULTS
    for _ in range(2):
        servers = Config.parse(text).servers()
        assert [(s.key, s.backup, s.check) for s in servers] == [
            ("a/s", False, True), ("b/s", True, True), ("c/s", False, True)
        ]
    edited = Config.parse(text.replace("127.0.0.1:1 check\nbackend c", "127.0.0.1:2 check\nbackend c"))
    assert [s.endpoint for s in edited.servers()] == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1"]
    moved = Config.parse(text.replace("backend a from plain", "backend a from backups"))
    assert [s.backup for s in moved.servers()] == [True, True, False]


def test_caches_keep_only_what_the_last_two_parses_used():
    """Memory stays bounded however many configs the daemon reads: entries of older parses go."""
    cache = ConfigCache()
    for i in range(5):
        cache.new_generation()
        Config.parse(f"backend b{i}\n  server s 127.0.0.1:{i}\n", cache).server_flags_by_backend()
    lines = set(cache.lines.current) | set(cache.lines.previous)
    assert lines == {"backend b3\n", "  server s 127.0.0.1:3\n", "backend b4\n", "  server s 127.0.0.1:4\n"}
    # Keyed by digests: a cache of a 100,000-server config's runs holds no second copy of its text.
    assert set(cache.kept(CHUNKS).current) | set(cache.kept(CHUNKS).previous) == {
        content_key("backend b3\n  server s 127.0.0.1:3\n"), content_key("backend b4\n  server s 127.0.0.1:4\n")
    }
    bodies = {body for _, body in [*cache.kept(SERVER_FLAGS).current, *cache.kept(SERVER_FLAGS).previous]}
    assert bodies == {content_key("  server s 127.0.0.1:3\n"), content_key("  server s 127.0.0.1:4\n")}


def test_a_parse_without_the_cache_leaves_it_as_it_was():
    """Only its owner starts a generation of a cache: parses elsewhere (a readiness check, the
    Ray bridge, an adoption) neither evict what the last builds kept nor fill it."""
    cache = ConfigCache()
    cache.new_generation()
    kept = Config.parse("backend kept\n  server s 127.0.0.1:1\n", cache)
    kept.servers()
    for i in range(3):
        Config.parse(f"backend other{i}\n  server s 127.0.0.1:{i}\n").servers()
    assert set(cache.lines.current) == {"backend kept\n", "  server s 127.0.0.1:1\n"}
    assert [key[0] for key in cache.kept(SECTION_SERVERS).current] == ["kept"]
    assert kept.copy().cache is cache  # an injection's copy keeps filling its parse's cache
