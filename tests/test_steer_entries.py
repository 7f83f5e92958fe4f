"""Pure decisions about displaced workers: the steer-map entries that send a dead server's slots to
live primaries or to the backup, fail-fast, and which servers are targets."""

from __future__ import annotations

import random

from rigs.wholes import known_dead_servers, steered_servers
from supervisor.haproxy.config import Config
from supervisor.steering.plan import FAIL_FAST
from tests.support.steering_cases import NEW, OLD, home_entries, live_of, model, routes, steer_map_entries

# ---------------------------------------------------------------- steer entries


def test_entries_spread_over_live_primaries_or_go_to_the_backup():
    old = model(OLD)
    dead = known_dead_servers(old, model(NEW), live_of(NEW), set())
    entries = steer_map_entries(old, dead, "fail-fast")
    assert entries == {
        "echo_0": "fallback",
        "echo_n": "1",
        "highscale_0": "fallback",
        "highscale_n": "1",
        "wide_0": "wide_r2",  # slots 1 and 2 are wide_r2 and wide_r3 in the slot table
        "wide_n": "3",
        "nobackup_0": "nb_r2",
        "nobackup_n": "2",
    }
    assert steered_servers(dead, entries) == sorted(dead)
    assert routes(old, entries, "wide") == ["wide_r2", "wide_r2", "wide_r3"]
    assert routes(old, entries, "highscale") == ["fallback"]


def test_a_second_dead_primary_adds_an_entry_and_changes_none():
    cfg = model("".join(["backend b\n", *(f"  server s{i} 10.0.0.{i}:80\n" for i in range(1, 7))]))
    one = steer_map_entries(cfg, frozenset({"b/s1"}), "fail-fast")
    assert one.keys() == {"b_0", "b_n"} and one["b_n"] == "6" and one["b_0"] != "s1"
    # any other primary but the one slot 0 went to: the count and the first override stay
    for other in (f"s{i}" for i in range(2, 7) if f"s{i}" != one["b_0"]):
        two = steer_map_entries(cfg, frozenset({"b/s1", f"b/{other}"}), "fail-fast")
        slot = int(other[1:]) - 1
        assert two.items() > one.items() and two.keys() - one.keys() == {f"b_{slot}"}
        assert sorted(set(routes(cfg, two, "b"))) == sorted({"s2", "s3", "s4", "s5", "s6"} - {other})
    # the one it went to: that override changes, to a server still alive
    three = steer_map_entries(cfg, frozenset({"b/s1", f"b/{one['b_0']}"}), "fail-fast")
    assert three["b_0"] not in {"s1", one["b_0"]}


def test_every_usable_primary_keeps_its_slot_and_dead_slots_go_to_usable_ones():
    """Whatever is dead, down, disabled or weightless: the slots a request can pick resolve
    to usable primaries only, each usable primary at least to its own slot, else to the
    backup targets once each, else to nothing; the steer map holds one override per
    unusable primary, plus the count; and one more dead server that is no override's target
    leaves every entry there as it was."""
    rng = random.Random(23)
    for _ in range(300):
        size = rng.randint(1, 12)
        lines = []
        for i in range(size):
            extra = rng.choice(["", "", "", " disabled", " weight 0", " backup"])
            lines.append(f"  server s{i} 10.0.0.{i + 1}:80{extra}\n")
        allbackups = "  option allbackups\n" if rng.random() < 0.3 else ""
        cfg = model(f"backend b\n{allbackups}{''.join(lines)}")
        servers = cfg.servers()
        if all(s.backup for s in servers):
            continue
        dead = frozenset(s.key for s in servers if rng.random() < 0.4)
        unusable = frozenset(s.key for s in servers if rng.random() < 0.15)
        entries = steer_map_entries(cfg, dead, "fail-fast", unusable)

        def ok(s, dead=dead, unusable=unusable) -> bool:
            return not s.disabled and s.weight != 0 and s.key not in unusable and s.key not in dead

        primaries, backups = [s for s in servers if not s.backup], [s for s in servers if s.backup]
        if not any(s.key in dead and not s.disabled and s.weight != 0 and s.key not in unusable for s in primaries):
            assert entries == {}
            continue
        usable = sorted(s.name for s in primaries if ok(s))
        live_backups = [s.name for s in backups if ok(s)]
        expected = usable or (live_backups if allbackups else live_backups[:1])
        got = routes(cfg, entries, "b")
        if not expected:
            assert entries == {"b_n": FAIL_FAST}
        elif usable:
            # Past the table's end, the draw slots of weighted_draws() (live primaries only).
            assert len(got) >= len(primaries) and set(got) == set(usable), (lines, dead, unusable, entries)
            home = home_entries(entries, len(primaries))
            assert len(home) - 1 == sum(1 for s in primaries if not ok(s))
            bystanders = [s for s in primaries if ok(s) and s.name not in entries.values()]
            if bystanders:
                more = steer_map_entries(cfg, dead | {rng.choice(bystanders).key}, "fail-fast", unusable)
                more_home = home_entries(more, len(primaries))
                assert more_home.items() - {("b_n", more["b_n"])} >= home.items() - {("b_n", entries["b_n"])}
                assert len(more_home) == len(home) + 1
        else:
            assert sorted(got) == sorted(expected), (lines, dead, unusable, entries)


def test_steered_servers_are_the_dead_ones_whose_backend_has_entries():
    old = model(OLD)
    dead = known_dead_servers(old, model(NEW), live_of(NEW), set()) | {"keeponly/k1"}
    steered = steered_servers(dead, steer_map_entries(old, dead, "keep"))
    assert "echo/echo_r1" in steered
    assert "keeponly/k1" not in steered  # dead, but nothing steers its backend


def test_no_primary_and_no_backup_fails_fast_or_is_left_alone():
    cfg = model("backend b\n  server s1 10.0.0.1:80\n")
    assert steer_map_entries(cfg, frozenset({"b/s1"}), "fail-fast") == {"b_n": FAIL_FAST}
    assert steer_map_entries(cfg, frozenset({"b/s1"}), "keep") == {}


def test_a_dead_backup_is_no_target():
    cfg = model("backend b\n  server s1 10.0.0.1:80\n  server bk 10.0.0.9:80 backup\n")
    assert steer_map_entries(cfg, frozenset({"b/s1", "b/bk"}), "fail-fast") == {"b_n": FAIL_FAST}


def test_first_backup_unless_allbackups():
    text = "backend b\n  server s1 10.0.0.1:80\n  server bk1 10.0.0.8:80 backup\n  server bk2 10.0.0.9:80 backup\n"
    dead = frozenset({"b/s1"})
    assert steer_map_entries(model(text), dead, "fail-fast") == {"b_0": "bk1", "b_n": "1"}
    both = text.replace("backend b\n", "backend b\n  option allbackups\n")
    assert steer_map_entries(model(both), dead, "fail-fast") == {"b_0": "bk1", "b_1": "bk2", "b_n": "2"}


def test_nothing_for_backends_without_dead_primaries_or_without_the_guard():
    cfg = model(OLD)
    assert steer_map_entries(cfg, frozenset({"echo/fallback"}), "fail-fast") == {}
    unguarded = Config.parse(OLD)
    assert steer_map_entries(unguarded, frozenset({"echo/echo_r1"}), "fail-fast") == {}


def test_servers_the_worker_itself_skips_are_no_targets_and_need_no_steering():
    cfg = model(OLD)
    dead = frozenset({"wide/wide_r1"})
    # wide_r2 is DOWN in the old worker itself: a use-server to it would be skipped
    assert steer_map_entries(cfg, dead, "fail-fast", unusable=frozenset({"wide/wide_r2"})) == {
        "wide_0": "wide_r3",
        "wide_1": "wide_r3",
        "wide_n": "3",
    }
    # the dead server is already DOWN there: its own balancing avoids it
    assert steer_map_entries(cfg, dead, "fail-fast", unusable=frozenset({"wide/wide_r1"})) == {}


def test_weight_zero_servers_are_no_targets():
    cfg = model("backend b\n  server s1 10.0.0.1:80\n  server s2 10.0.0.2:80 weight 0\n  server s3 10.0.0.3:80\n")
    assert steer_map_entries(cfg, frozenset({"b/s1"}), "fail-fast") == {"b_0": "s3", "b_1": "s3", "b_n": "3"}


def test_tracking_servers_are_steered_like_any_primary():
    cfg = model(
        "backend b\n  server s1 10.0.0.1:80 check\n  server s2 10.0.0.2:80 check\n"
        "backend via\n  server s1 10.0.0.1:80 track b/s1\n  server s2 10.0.0.2:80 track b/s2\n"
    )
    assert steer_map_entries(cfg, frozenset({"b/s1", "via/s1"}), "fail-fast") == {
        "b_0": "s2",
        "b_n": "2",
        "via_0": "s2",
        "via_n": "2",
    }
