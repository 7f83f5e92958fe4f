"""What the guard reproduces of HAProxy's choice (haproxy/routing.py), and the steer-map entries
that keep a steered backend's weights and hash positions (steering/plan.py): pure logic,
tables. tests/test_fidelity_e2e.py checks the same against real HAProxy."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rigs.wholes import inject_guard, steer_entries
from supervisor.haproxy.config import Config
from supervisor.haproxy.guard import inject_guard_and_table, slot_table
from supervisor.haproxy.routing import (
    BUCKET_BITS,
    HASHED_ID,
    ID_TIMES_4096,
    PLAIN,
    Routing,
    consistent_buckets,
    lookup,
    ring,
    routing_of,
    server_ids,
    server_map,
)
from supervisor.steering.dead import Sections
from tests.support import reference_build as reference

MAP, TABLE = "/run/hs/steer.map", "/run/hs/slots-0.map"


def routing(lines: str, mode: str = "http", defaults: str = "") -> Routing:
    config = Config.parse(f"defaults\n  mode {mode}\n{defaults}backend b\n{lines}  server s1 10.0.0.1:80\n")
    section = next((s for s in config.backends() if s.name == "b"), None)
    assert section is not None
    return routing_of(reference.settings_of(config, section), section.body, "b")


@pytest.mark.parametrize(
    ("lines", "cookie"),
    [
        ("  cookie SRV insert indirect nocache\n", "req.cook(SRV)"),
        ("  cookie SRV rewrite\n", "req.cook(SRV)"),
        ("  cookie JSESSIONID prefix nocache\n", "req.cook(JSESSIONID),field(1,~)"),
        ("  cookie SRV insert maxidle 30m\n", "req.cook(SRV),field(1,|)"),
        ("  cookie SRV insert dynamic\n", None),  # values hashed from addresses: not reproduced
        ("", None),
    ],
)
def test_cookie_persistence_is_read_as_haproxy_reads_it(lines, cookie):
    assert routing(lines).cookie == cookie


def test_cookie_from_defaults_and_none_in_tcp_mode():
    assert routing("", defaults="  cookie SRV insert\n").cookie == "req.cook(SRV)"
    assert routing("  cookie SRV insert\n", mode="tcp").cookie is None


@pytest.mark.parametrize(
    ("lines", "sticks"),
    [
        ("  stick on src\n", ("src,table_server_id(b)",)),
        ("  stick match req.hdr(x-user) table t2\n  stick on src\n",
         ("req.hdr(x-user),table_server_id(t2)", "src,table_server_id(b)")),
        ("  stick store-request src\n", ()),  # stores only
        ("  stick on src if { src 10.0.0.0/8 }\n", ()),  # a condition the guard does not evaluate
    ],
)
def test_stick_rules_that_match(lines, sticks):
    assert routing(lines).sticks == sticks


@pytest.mark.parametrize(
    ("lines", "key", "function"),
    [
        ("  balance uri\n", "url,field(1,?)", "sdbm"),
        ("  balance uri whole\n", "url", "sdbm"),
        ("  balance uri path-only\n", "path", "sdbm"),
        ("  balance uri len 10\n", None, None),
        ("  balance uri\n  hash-type consistent\n", "url,field(1,?)", "sdbm(1)"),  # avalanche by default
        ("  balance uri\n  hash-type consistent djb2\n", "url,field(1,?)", "djb2"),
        ("  balance uri\n  hash-type consistent\n  hash-balance-factor 150\n", None, None),
        ("  balance source\n  hash-type consistent\n", None, None),  # no converter is full_hash alone
        ("  balance uri\n  hash-type map-based djb2 avalanche\n", "url,field(1,?)", "djb2(1)"),
        ("  balance source\n", "src", None),
        ("  balance hdr(x-key)\n", "req.hdr(x-key,1)", "sdbm"),
        ("  balance hdr(host) use_domain_only\n", None, None),
        ("  balance url_param k\n", "url_param(k)", "sdbm"),
        ("  balance url_param k check_post\n", None, None),
        ("  balance rdp-cookie(mstshash)\n", "req.rdp_cookie(mstshash)", "sdbm"),
        ("  balance hash req.cook(u)\n", "req.cook(u)", "sdbm"),
        ("  balance roundrobin\n", None, None),
        ("  balance leastconn\n", None, None),
    ],
)
def test_map_based_hashing_is_reproduced_with_haproxys_converters(lines, key, function):
    got = routing(lines)
    assert (got.hash_key, got.hash_function) == (key, function)


def test_server_ids_are_haproxys_puids():
    servers = [("a", ()), ("b", ("id", "1")), ("c", ("weight", "3")), ("d", ("id", "3")), ("e", ())]
    assert server_ids(servers) == {"a": 2, "b": 1, "c": 4, "d": 3, "e": 5}


def servers_of(lines: str) -> list:
    return Config.parse(f"backend b\n{lines}").servers()


def test_server_map_is_lb_maps():
    equal = servers_of("  server a 10.0.0.1:80\n  server b 10.0.0.2:80\n  server c 10.0.0.3:80\n")
    assert server_map(equal, ["a", "b", "c"]) == ["a", "b", "c"]
    assert server_map(equal, ["a", "c"]) == ["a", "c"]  # a server seen down is not in it
    weighted = servers_of("  server a 10.0.0.1:80 weight 10\n  server b 10.0.0.2:80 weight 90\n")
    table = server_map(weighted, ["a", "b"])
    assert len(table) == 10 and table.count("a") == 1  # weights over their gcd
    zero = servers_of("  server a 10.0.0.1:80 weight 0\n  server b 10.0.0.2:80\n  server k 10.0.0.3:80 backup\n")
    assert server_map(zero, ["a", "b", "k"]) == ["b"]
    assert server_map(zero, ["k"]) == []


def steered(text: str, dead: set[str], unusable: frozenset[str] = frozenset()) -> tuple[Config, dict[str, str]]:
    config = inject_guard(Config.parse(text), MAP, TABLE)
    return config, steer_entries(Sections().digest(config), frozenset(dead), "fail-fast", unusable)


def draw_shares(config: Config, entries: dict[str, str], backend: str) -> dict[str, float]:
    """Each server's share of the guard's draws: a slot drawn up to three times while the
    steer map overrides a slot of the table, then the steer map's entry, else the table's."""
    table = dict(slot_table(config)).get(backend, [])
    n = int(entries[f"{backend}_n"])
    shares: dict[str, float] = {}
    redraw = [i < len(table) and f"{backend}_{i}" in entries for i in range(n)]
    p_redraw = sum(redraw) / n
    for i in range(n):
        server = entries.get(f"{backend}_{i}") or table[i]
        weight = (1 / n) * sum(p_redraw**k for k in range(3)) if not redraw[i] else (1 / n) * p_redraw**2
        shares[server] = shares.get(server, 0.0) + weight
    return shares


def test_draws_keep_every_share_within_3_points_of_the_weights():
    rng = random.Random(24)
    for _ in range(2000):
        size = rng.randint(2, 9)
        weights = [rng.choice([0, 1, 1, 1, 2, 3, 10, 50, 90]) for _ in range(size)]
        lines = "".join(f"  server s{i} 10.0.0.{i + 1}:80 weight {w}\n" for i, w in enumerate(weights))
        dead = {f"b/s{i}" for i in range(size) if rng.random() < 0.4}
        live = {f"s{i}": w for i, w in enumerate(weights) if w and f"b/s{i}" not in dead}
        if not live or not any(weights[int(k[3:])] for k in dead):
            continue
        config, entries = steered(f"backend b\n{lines}", dead)
        shares = draw_shares(config, entries, "b")
        total = sum(live.values())
        assert set(shares) == set(live), (weights, dead, entries)
        for name, w in live.items():
            assert abs(100 * shares[name] - 100 * w / total) < 3, (weights, dead, entries, shares)


def test_equal_weights_and_a_few_dead_cost_no_draw_slot():
    lines = "".join(f"  server s{i} 10.0.0.{i + 1}:80\n" for i in range(10))
    _, entries = steered(f"backend b\n{lines}", {"b/s3", "b/s7"})
    assert entries["b_n"] == "10" and len(entries) == 3


def test_hash_entries_override_the_dead_servers_positions_only():
    text = "backend b\n  balance uri\n" + "".join(
        f"  server s{i} 10.0.0.{i + 1}:80{' weight 2' if i == 1 else ''}\n" for i in range(4)
    )
    config, entries = steered(text, {"b/s2"})
    servers = config.servers()
    table = server_map(servers, [s.name for s in servers])
    assert entries["b_t"] == str(len(table)) == "5"
    hashed = {k: v for k, v in entries.items() if k.startswith("b_h")}
    assert set(hashed) == {f"b_h{i}" for i, name in enumerate(table) if name == "s2"}
    assert set(hashed.values()) <= {"s0", "s1", "s3"}
    # The worker's own view: a server it sees down is out of its map, and so out of the total.
    _, seen = steered(text, {"b/s2"}, frozenset({"b/s3"}))
    assert seen["b_t"] == "4" and "s3" not in seen.values()


def test_the_slot_table_names_home_slots_for_cookies_and_stick_entries(tmp_path: Path):
    text = (
        "defaults\n  mode http\n  default-server cookie dflt\n"
        "backend b\n  cookie SRV insert\n  stick-table type ip size 1k\n  stick on src\n"
        "  server k 10.0.0.9:80 backup cookie kk\n  server s1 10.0.0.1:80 cookie c1 id 7\n"
        "  server s2 10.0.0.2:80\n  server s3 10.0.0.3:80 cookie c1\n"
        "backend plain\n  server p 10.0.0.5:80\n"
    )
    table = inject_guard_and_table(Config.parse(text), "/run/hs/steer.map", tmp_path)[1]
    rows = table.text.splitlines()
    assert rows[:4] == ["b_0 s1", "b_1 s2", "b_2 s3", "plain_0 p"]
    # the first server with a cookie value takes it (s3's c1 names s1); a backup has no home slot
    assert rows[4:] == ["b/cc1 0", "b/cdflt 1", "b/s7 0", "b/s2 1", "b/s3 2"]
    config = Config.parse(text)
    plain = next(s for s in config.backends() if s.name == "plain")
    assert routing_of(reference.settings_of(config, plain), [], "plain") == PLAIN


@pytest.mark.parametrize("node_keys", [ID_TIMES_4096, HASHED_ID])
def test_consistent_buckets_catch_every_dead_hash_and_few_live_ones(node_keys):
    servers = servers_of("".join(f"  server s{i} 10.0.0.{i + 1}:80{' weight 3' if i == 2 else ''}\n" for i in range(5)))
    ids = server_ids([(s.name, s.params) for s in servers])
    points = ring(servers, [s.name for s in servers], ids, node_keys)
    assert len(points) == 16 * 7
    buckets = consistent_buckets(points, {"s1"})
    keys = [k for k, _ in points]
    rng = random.Random(7)
    moved = dead = 0
    for _ in range(20000):
        h = rng.getrandbits(32)
        server, bucket = lookup(points, keys, h), h >> (32 - BUCKET_BITS)
        if server == "s1":
            dead += 1
            assert buckets.get(bucket, "s1") != "s1"  # every dead hash is overridden, to a live server
        else:
            moved += bucket in buckets and buckets[bucket] != server
    assert dead > 0 and moved / (20000 - dead) < 0.01
    assert consistent_buckets(points, set()) == {}
