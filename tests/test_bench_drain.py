"""bench/drain.py's own logic: which connections carry the requests, and the table it prints."""

from __future__ import annotations

from bench.drain import Answer, Result, rows, spread, table


def test_requests_go_to_the_apps_in_turn_and_to_every_old_worker():
    held = {(g, app): [f"{g}{app}{k}" for k in range(2)] for g in (1, 2) for app in ("echo", "highscale", "wide")}
    chosen = spread(held, 9)
    assert [client for _, client in chosen] == [
        "1echo0", "2echo0", "1highscale0", "2highscale0", "1wide0", "2wide0", "1echo1", "2echo1", "1highscale1",
    ]
    assert [app for app, _ in chosen][:2] == ["echo", "echo"]
    assert len(spread(held, 100)) == 12  # never more than the connections held


def test_table_counts_failed_and_slow_and_compares_with_the_supervisor():
    plain = Result("plain", [Answer("echo", 503, 4.0), Answer("wide", 200, 3.0), Answer("wide", 200, 0.01)])
    supervisor = Result("supervisor", [Answer("echo", 200, 0.002), Answer("wide", 200, 0.002),
                                       Answer("wide", 200, 0.003)])
    lines = table([plain, supervisor]).splitlines()
    assert lines[2] == "| plain | 1 / 3 | 2 | 4.0 s | 3.0 s | 7.0 s | 1,001 |"
    assert lines[3] == "| supervisor | 0 / 3 | 0 | 0.003 s | 0.002 s | 0.007 s | 1 |"


def test_a_ratio_below_ten_keeps_two_digits():
    fast = Result("fast", [Answer("echo", 200, 0.5)])
    slow = Result("slow", [Answer("echo", 200, 0.75)])
    basis = Result("basis", [Answer("echo", 200, 1.0)])
    assert [row[-1] for row in rows([fast, slow, basis])] == ["0.5", "0.75", "1"]
