"""Pure decisions about displaced workers: the lines a push sends (per-backend deltas merged within
the line limit), and reading HAProxy's answers to them and to `show map`."""

from __future__ import annotations

import random

from rigs.wholes import diff_map
from supervisor.haproxy.config import Config
from supervisor.steering.dead import line_limit
from supervisor.steering.mapdiff import (
    ROUTING_PHASES,
    BackendDelta,
    answer_problem,
    backend_delta,
    delta_lines,
    is_whole_answer,
    map_entries,
)
from tests.support.steering_cases import MAP


def resolve(entries: dict[str, str], backend: str, slot: int) -> str:
    """Where the guard sends a request that picked `slot`: the override, else the slot table's
    server (`tbl<i>` in these tests), then that server's hop if it has one."""
    server = entries.get(f"{backend}_{slot}", f"tbl{slot}")
    return entries.get(f"{backend}/{server}", server)


def resolved_routes(entries: dict[str, str]) -> dict[str, set[str]]:
    """Per steered backend, the servers its slots resolve to."""
    return {
        k[:-2]: {resolve(entries, k[:-2], i) for i in range(int(v))}
        for k, v in entries.items()
        if k.endswith("_n") and int(v) > 0
    }


def run_lines(
    current: dict[str, str],
    ranks: list[list[str]],
    pid: int,
    rng: random.Random,
    desired: dict[str, str] | None = None,
    routing_ranks: int = 0,
) -> dict[str, str]:
    """Play CLI lines the way HAProxy takes them: ranks in order, a rank's lines in any order
    (parallel connections), each line's commands or payload entries in order. After every
    step, no count key may promise a slot that is not there; and once the first
    `routing_ranks` are played, every request goes where `desired` sends requests."""
    result = dict(current)
    played = 0

    def check() -> None:
        for k, v in result.items():
            if k.endswith("_n") and v.isdigit():
                assert all(f"{k[:-2]}_{i}" in result for i in range(int(v))), result
        if desired is not None and played >= routing_ranks:
            wanted = resolved_routes(desired)
            for backend, servers in resolved_routes(result).items():
                assert backend in wanted and servers <= wanted[backend], (backend, servers, result, desired)

    for lines in ranks:
        if played == routing_ranks:
            check()
        for line in rng.sample(lines, len(lines)):
            head, _, payload = line.partition("\n")
            if head.endswith("<<"):
                assert head == f"@!{pid} add map {MAP} <<"
                for entry in payload.splitlines():
                    key, value = entry.split(" ")
                    assert key not in result
                    result[key] = value
                    check()
                continue
            for command in head.split(";"):
                words = command.split(" ")
                assert words[:4] in ([f"@!{pid}", "set", "map", MAP], [f"@!{pid}", "del", "map", MAP])
                if words[1] == "set":
                    assert words[4] in result
                    result[words[4]] = words[5]
                else:
                    del result[words[4]]
                check()
        played += 1
    return result


def test_delta_lines_merge_backends_and_reach_the_desired_map():
    rng = random.Random(7)
    for _ in range(300):
        backends = [f"be{i}" for i in range(rng.randint(1, 12))]
        before: dict[str, dict[str, str]] = {}
        after: dict[str, dict[str, str]] = {}
        for b in backends:
            for side in (before, after):
                n = rng.choice([None, 0, 1, 2, 5, 40])
                slots = {f"{b}_{i}": f"srv{rng.randint(0, 9)}" for i in range(n or 0)}
                side[b] = {} if n is None else {**slots, f"{b}_n": str(n)}
        deltas = [backend_delta(tuple(sorted(before[b].items())), tuple(sorted(after[b].items()))) for b in backends]
        limit = rng.choice([300, 1000, 16000])
        ranks = delta_lines(9, MAP, deltas, limit)
        assert all(len(line.encode()) <= limit for lines in ranks for line in lines)
        current = {k: v for b in backends for k, v in before[b].items()}
        desired = {k: v for b in backends for k, v in after[b].items()}
        routing = len(delta_lines(9, MAP, deltas, limit, range(ROUTING_PHASES)))
        assert run_lines(current, ranks, 9, rng, desired, routing) == desired
        whole = diff_map(current, desired)
        assert sum(d.changes for d in deltas) == sum(len(p.adds) + len(p.sets) + len(p.dels) for p in whole)
        # the same maps diffed whole, as a worker without per-backend parts is pushed
        whole = [BackendDelta.between(current, desired)]
        whole_lines = delta_lines(9, MAP, whole, limit)
        routing = len(delta_lines(9, MAP, whole, limit, range(ROUTING_PHASES)))
        assert run_lines(current, whole_lines, 9, rng, desired, routing) == desired


def test_a_newly_steered_backend_travels_in_one_payload_line():
    entries = {"app_0": "r2", "app_1": "r3", "app_n": "2"}
    ranks = delta_lines(5, MAP, [BackendDelta.between({}, entries)])
    assert ranks == [[f"@!5 add map {MAP} <<\napp_0 r2\napp_1 r3\napp_n 2\n"]]
    assert delta_lines(5, MAP, [BackendDelta.between(entries, entries)]) == []


def test_map_entries_from_show_map():
    answer = "0x55d1 a_0 s1\n0x55d2 a_n 1\n0x55d3 b_0 s1\n0x55d4 b_0 s2\n0x55d5 c_0 s1\n0x55d6 c_0 s1\n\n"
    assert map_entries(answer) == {"a_0": "s1", "a_n": "1", "b_0": "", "c_0": "s1"}
    assert map_entries("\n") == {}


def test_line_limit_follows_tune_bufsize():
    assert line_limit(Config.parse("global\n  tune.bufsize 8192\n")) == 8192 - 384
    assert line_limit(Config.parse("global\n  maxconn 10\n")) == 16000
    assert line_limit(Config.parse("global\n  tune.bufsize 65536\n")) == 16000


def test_answer_problem_needs_one_empty_line_per_command():
    three = "@!1 set map /m a 1;@!1 set map /m b 2;@!1 del map /m c"
    assert answer_problem(three, "\n\n\n") is None
    assert answer_problem(three, "\nentry not found.\n\n\n") == "entry not found."
    assert "connection dropped" in answer_problem(three, "\n")
    assert "connection dropped" in answer_problem("@!1 add map /m <<\nk v\nk2 v\n", "")
    assert answer_problem("@!1 add map /m <<\nk v;x\n", "\n") is None  # payload bytes are not commands


def test_a_show_map_answer_cut_off_is_told_from_a_whole_one():
    # as 2.6.12 answered through the master CLI
    whole = "0x7f8d54046500 k1 v1\n0x556ce3bceab0 k2 v2\n\n"
    assert is_whole_answer(whole) and is_whole_answer("\n")
    for cut in (whole[:-1], whole[:25], whole[: whole.index("\n") + 1], ""):
        assert not is_whole_answer(cut), repr(cut)
