"""The status page (supervisor/page/): what it shows, at demo size and at fleet size."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from rigs.status_state import (
    CURRENT_PID,
    HOSTILE_ERROR,
    OLD_PIDS,
    fleet_dead,
    fleet_state,
    running_state,
)
from supervisor.haproxy.config import Config
from supervisor.page import (
    CHART_W,
    BackendSizes,
    History,
    backend_sizes,
    damage_by_backend,
    old_workers_chart,
    page_of,
    reload_chart,
    render_page,
    running_generations,
)
from supervisor.settings import Settings
from supervisor.state import CHART_POINTS, Generation, OldWorker, ReloadRecord, State
from supervisor.status.document import status_document
from supervisor.statusclient import format_age, format_bytes

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def page(state: State) -> str:
    return page_of(state, status_document(state, Settings(), NOW), NOW, BackendSizes())


GROUP = re.compile(r'<div class="group (all|half|some)" data-count="([^"]+)">(.*?)</div>', re.S)
BACKEND = re.compile(r'<span class="be[^"]*" data-backend="([^"]+)" title="([^"]*)">([^<]+)</span>')


def backend_labels(html: str) -> list[str]:
    """`backend: count` for every backend the page lists, in the page's order."""
    labels = []
    for _tone, count, body in GROUP.findall(html):
        head = re.search(r'<span class="head">([^<]+)</span>', body)
        assert head is not None and head[1] == count
        labels += [f"{backend}: {count}" for backend, _, shown in BACKEND.findall(body) if shown == backend]
    return labels


def test_page_shows_workers_steering_and_reloads():
    html = page(running_state(NOW))
    assert '<meta http-equiv="refresh" content="5">' in html
    for pid in (CURRENT_PID, *OLD_PIDS):
        assert f">{pid}<" in html
    for key in ("app/app1", "echo/echo_r1", "highscale/highscale_r2"):
        assert f">{key}<" in html
    assert "40m 00s" in html and "3m 00s" in html
    assert 'highscale/highscale_r2 <span class="tag">operator</span>' in html
    assert html.count('<tr class="reload">') == 7


def test_page_groups_dead_servers_by_backend_with_the_running_configs_sizes():
    html = page(running_state(NOW))
    # rayserve.cfg's echo and highscale, handwritten_basic.cfg's app: one dead each.
    sizes = BackendSizes().of(running_generations(running_state(NOW)))
    expected = {
        f"{backend}: 1 of {sizes[backend]} dead" for backend in ("app", "echo", "highscale")
    }
    assert set(backend_labels(html)) == expected


def test_page_escapes_everything():
    html = page(running_state(NOW))
    assert "<script" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&#x27;" in html  # the quotes around it too
    assert HOSTILE_ERROR not in html


def test_page_has_no_external_assets():
    html = page(fleet_state(NOW))
    assert not re.search(r"<(script|link|img|iframe)\b", html)
    assert not re.search(r"(src|href)=\"(https?:)?//", html)
    assert html.count("<svg") == 3


def test_page_of_a_fresh_daemon():
    state = State(started_at=NOW)
    html = render_page(status_document(state, Settings(), NOW), NOW, {}, History.of(state))
    assert "No old workers" in html and "No reloads yet" in html and "master down" in html
    assert "No dead servers" in html and "no reloads yet" in html and "no pushes yet" in html


HEADER = re.compile(r"<header>(.*?)</header>", re.S)
NOW_PANEL = re.compile(r'<section id="summary">(.*?)</section>', re.S)


def test_page_shows_convergence_in_the_header_and_why_not_in_the_now_panel():
    state = running_state(NOW)
    state.convergence.reached()
    html = page(state)
    assert '<span class="badge good">converged</span>' in HEADER.search(html)[1]
    assert 'id="convergence"' not in html

    state.convergence.missed("reload failed: <b>show proc</b>: no answer", transient=True,
                             now=NOW - timedelta(seconds=95))
    state.convergence.attempts = 3
    html = page(state)
    header, now_panel = HEADER.search(html)[1], NOW_PANEL.search(html)[1]
    assert re.search(r'<span class="badge warn" id="convergence-badge"[^>]*>not converged 1m 35s</span>', header)
    assert '<div class="convergence warn" id="convergence"><b>Not converged</b> since' in now_panel
    assert "2025-01-02 03:02:30" in now_panel
    assert "reload failed: &lt;b&gt;show proc&lt;/b&gt;: no answer" in now_panel
    assert "<b>show proc</b>" not in html
    assert "retried with backoff (3 attempts so far)" in now_panel

    state.convergence.missed("the rendered config is invalid: unknown keyword 'bnd'", transient=False)
    html = page(state)
    assert re.search(r'<span class="badge bad" id="convergence-badge"', HEADER.search(html)[1])
    now_panel = NOW_PANEL.search(html)[1]
    assert '<div class="convergence bad" id="convergence">' in now_panel
    assert "the config is the problem" in now_panel and "unknown keyword &#x27;bnd&#x27;" in now_panel


# ---------------------------------------------------------------- at fleet size


def test_every_affected_backend_of_a_fleet_drain_is_listed_worst_first_with_its_count():
    html = page(fleet_state(NOW))
    labels = backend_labels(html)
    dead = fleet_dead()
    assert sorted(labels) == sorted(f"{backend}: {count} of 10 dead" for backend, count in dead.items())
    # Worst first: the backends with no live server, then 3 of 10, then 1 of 10.
    counts = [int(label.split(": ")[1].split()[0]) for label in labels]
    assert counts == sorted(counts, reverse=True)
    assert labels[0] == "b0: 10 of 10 dead"
    assert labels[9:12] == ["b9: 10 of 10 dead", "b10: 3 of 10 dead", "b11: 3 of 10 dead"]  # b9 before b10
    assert len(GROUP.findall(html)) == 3 and GROUP.findall(html)[0][:2] == ("all", "10 of 10 dead")
    # Names are not listed one by one at this size; each backend's are in its tooltip.
    assert "b10/r" not in html and 'title="b10: 3 of 10 dead: r0, r1, r2. Steered away in 50 of 50 old workers"' in html
    # An old worker's 1,000 steered servers are counted, not named.
    assert html.count("1,000 servers in 710 backends") == 50


def test_a_dead_backend_no_old_worker_is_steered_from_is_marked():
    state = fleet_state(NOW, old_workers=2)
    for worker in state.old_workers.values():
        worker.steered = [key for key in worker.steered if not key.startswith("b0/")]
    html = page(state)
    assert re.search(r'<span class="be unsteered" data-backend="b0"', html)
    assert re.search(r'<span class="be" data-backend="b1"', html)


def test_damage_by_backend_orders_by_share_then_count():
    damage = damage_by_backend(
        ["big/a", "big/b", "big/c", "small/a", "small/b", "gone/x", "half/a"],
        ["small/a"],
        [{"steered": ["big/a", "big/b"]}, {"steered": ["big/c", "small/a"]}],
        {"big": 10, "small": 2, "half": 2},
    )
    assert [(d.label, d.operator, d.steered_in) for d in damage] == [
        ("small: 2 of 2 dead", 1, 1),
        ("gone: 1 dead", 0, 0),  # in no running config: its size is unknown, counted as all dead
        ("half: 1 of 2 dead", 0, 0),
        ("big: 3 of 10 dead", 0, 2),
    ]
    assert [d.tone for d in damage] == ["all", "all", "half", "some"]


def test_backend_sizes_count_templates_and_backups():
    model = Config.parse(
        "defaults\n    mode http\n\nbackend a\n    server s1 127.0.0.1:1\n    server-template t 1-5 127.0.0.1:2\n"
        "    server f 127.0.0.1:3 backup\n\nlisten l\n    bind 127.0.0.1:4\n    server s 127.0.0.1:5\n"
        "\nbackend empty\n"
    )
    assert backend_sizes(model) == {"a": 7, "l": 1, "empty": 0}


def test_backend_sizes_are_kept_by_config_content():
    small = Config.parse("backend a\n    server s1 127.0.0.1:1\n")
    large = Config.parse("backend a\n    server s1 127.0.0.1:1\n    server s2 127.0.0.1:2\n")
    sizes = BackendSizes()
    assert sizes.of([Generation(1, small, "sha-1", "r", NOW)]) == {"a": 1}
    # The same content (sha) in another object: the counted sizes are reused.
    assert sizes.of([Generation(2, large, "sha-1", "r", NOW)]) == {"a": 1}
    # Other content is counted; a backend's largest size among the running configs wins.
    assert sizes.of([Generation(2, large, "sha-2", "r", NOW), Generation(1, small, "sha-1", "r", NOW)]) == {"a": 2}


# ---------------------------------------------------------------- history and charts


def test_chart_history_is_bounded():
    state = State()
    for i in range(CHART_POINTS * 3):
        state.reloads.record("ok", float(i))
        state.push_duration.observe(0.01)
    assert len(state.reloads.chart) == CHART_POINTS and state.reloads.chart[-1].duration_ms == CHART_POINTS * 3 - 1
    assert len(state.push_duration.recent) == CHART_POINTS
    assert len(state.reloads.history) == 20  # /status's `recent` is unchanged


def test_old_workers_are_noted_when_their_number_changes_or_after_a_while():
    state = State()
    state.note_old_workers(NOW)
    state.note_old_workers(NOW + timedelta(seconds=1))  # same count, too soon: not noted
    state.old_workers[1] = OldWorker(1, 1, NOW)
    state.note_old_workers(NOW + timedelta(seconds=2))
    state.note_old_workers(NOW + timedelta(seconds=2 + State.OLD_WORKER_SAMPLE_S))
    assert [(int((at - NOW).total_seconds()), n) for at, n in state.old_worker_counts] == [
        (0, 0), (2, 1), (2 + int(State.OLD_WORKER_SAMPLE_S), 1),
    ]
    for i in range(CHART_POINTS * 2):
        state.old_workers[i + 10] = OldWorker(i + 10, 1, NOW)
        state.note_old_workers(NOW)
    assert len(state.old_worker_counts) == CHART_POINTS


def test_reload_chart_draws_a_bar_per_reload_coloured_by_result():
    records = [
        ReloadRecord(NOW - timedelta(minutes=3), "ok", 180.0),
        ReloadRecord(NOW - timedelta(minutes=2), "invalid", 30.0),
        ReloadRecord(NOW - timedelta(minutes=1), "failed", 30000.0),
    ]
    svg = reload_chart(records, NOW)
    bars = re.findall(r'<rect [^>]*height="([\d.]+)" fill="(#\w+)"><title>([^<]*)</title>', svg)
    assert [fill for _, fill, _ in bars] == ["#2f9e44", "#e03131", "#e03131"]
    heights = [float(h) for h, _, _ in bars]
    assert heights[2] > heights[0] > heights[1]  # log scale, longest highest
    assert "max 30.0 s" in svg and "3 reloads, since 3m 00s ago" in svg


def test_old_workers_chart_steps_through_every_change():
    points = [(NOW - timedelta(minutes=10), 0), (NOW - timedelta(minutes=5), 3), (NOW - timedelta(minutes=1), 1)]
    svg = old_workers_chart(points, NOW)
    polyline = re.search(r'<polyline points="([^"]+)"', svg)
    assert polyline is not None
    xy = [tuple(map(float, p.split(","))) for p in polyline[1].split()]
    assert len(xy) == 1 + 2 * 2 + 1  # start, two steps of two points, now
    assert xy[-1][0] == pytest.approx(CHART_W)  # reaches the right edge (now)
    ys = [y for _, y in xy]
    assert min(ys) == ys[2] == ys[3]  # the 3 old workers are the highest point
    assert "max 3" in svg and "now 1" in svg


def test_history_of_a_state_reads_its_series():
    state = fleet_state(NOW)
    history = History.of(state)
    assert len(history.reloads) == len(history.pushes) == len(history.old_workers) == 60


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "?"), (-3.5, "0s"), (0, "0s"), (59.9, "59s"), (60, "1m 00s"), (3599, "59m 59s"), (3600, "1h 00m"),
        (90061, "1d 01h"),
    ],
)
def test_format_age(seconds, text):
    assert format_age(seconds) == text


def test_format_bytes():
    assert [format_bytes(v) for v in (None, 512, 2048, 41 * 1024**2, 3 * 1024**3)] == [
        "?", "512 B", "2.0 KiB", "41.0 MiB", "3.0 GiB",
    ]
