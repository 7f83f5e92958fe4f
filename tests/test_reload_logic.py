"""Pure decisions of the reloader: scheduling, confirming a reload, old-worker limit, relevant paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.haproxy.answers import parse_show_proc
from supervisor.reloader.decisions import ReloadScheduler, confirm_reload, one_line, retry_delay, runs_goal
from supervisor.reloader.records import old_workers_over_max
from supervisor.reloader.watch import inputs_digest, split_watch

HEAD = "#<PID>          <type>          <reloads>       <uptime>        <version>\n"


def show_proc(master_reloads: int, failed: int, current: int, old: tuple[tuple[int, int], ...] = ()) -> str:
    """A `show proc` answer in 2.6's shape; `old` is ((pid, reloads), ...)."""
    text = HEAD + f"100             master          {master_reloads} [failed: {failed}]   0d00h00m09s     2.6.12\n"
    text += "# workers\n" + f"{current}             worker          0               0d00h00m01s     2.6.12\n"
    if old:
        text += "# old workers\n"
        for pid, reloads in old:
            text += f"{pid}             worker          {reloads}               0d00h00m05s     2.6.12\n"
    return text + "# programs\n\n"


# ---------------------------------------------------------------- scheduler


def test_burst_gives_one_reload_after_the_last_change():
    s = ReloadScheduler(debounce_s=0.1, min_interval_s=1.0)
    for i in range(300):  # a write every 5 ms for 1.5 s
        now = i * 0.005
        s.changed(now)
        assert not s.take(now), "nothing may fire while the burst goes on"
    last = 299 * 0.005
    assert s.due_at() == pytest.approx(last + 0.1)
    assert not s.take(last + 0.099)
    assert s.take(last + 0.1)
    assert not s.pending and s.due_at() is None
    assert not s.take(last + 5)


def test_min_interval_coalesces_changes_after_a_reload():
    s = ReloadScheduler(debounce_s=0.1, min_interval_s=2.0)
    s.changed(0.0)
    assert s.take(0.1)
    s.last_reload = 0.15
    # two more bursts before the interval is over: one reload, at the interval's end
    s.changed(0.5)
    s.changed(1.2)
    assert s.due_at() == pytest.approx(2.15)
    assert not s.take(1.4)
    assert not s.take(2.1)
    assert s.take(2.15)
    assert s.due_at() is None


def test_debounce_still_applies_after_the_interval():
    s = ReloadScheduler(debounce_s=0.3, min_interval_s=1.0)
    s.last_reload = 0.0
    s.changed(5.0)
    assert s.due_at() == pytest.approx(5.3)


def test_zero_min_interval_and_clear():
    s = ReloadScheduler(debounce_s=0.05, min_interval_s=0.0)
    s.last_reload = 1.0
    s.changed(1.0)
    assert s.due_at() == pytest.approx(1.05)
    s.clear()
    assert s.due_at() is None and s.earliest_reload() == 1.0


@pytest.mark.parametrize(
    ("writes", "debounce_s", "max_delay_s", "min_interval_s", "due"),
    [
        # a write every 100 ms with a 200 ms debounce: due 1 s after the first write, not never
        ([i * 0.1 for i in range(200)], 0.2, 1.0, 0.0, 1.0),
        # one write: the debounce, as before
        ([5.0], 0.2, 1.0, 0.0, 5.2),
        # a burst shorter than the maximum wait: the debounce after its last write
        ([0.0, 0.1, 0.2], 0.2, 1.0, 0.0, 0.4),
        # the last write just before the maximum: the maximum wins over its debounce
        ([0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9], 0.2, 1.0, 0.0, 1.0),
        # the maximum never overrides min_interval after a reload at 0
        ([0.1 * i for i in range(1, 30)], 0.2, 1.0, 2.0, 2.0),
        # no maximum (the default): the debounce after the last write
        ([i * 0.1 for i in range(50)], 0.2, float("inf"), 0.0, 4.9 + 0.2),
    ],
)
def test_a_burst_is_due_at_the_latest_max_delay_after_its_first_write(writes, debounce_s, max_delay_s,
                                                                      min_interval_s, due):
    s = ReloadScheduler(debounce_s=debounce_s, min_interval_s=min_interval_s, max_delay_s=max_delay_s)
    if min_interval_s:
        s.last_reload = 0.0
    for now in writes:
        s.changed(now)
    assert s.due_at() == pytest.approx(due)
    assert s.take(due - 0.001) is None
    assert s.take(due) == "change"
    assert not s.pending


def test_the_next_burst_counts_its_maximum_from_its_own_first_write():
    s = ReloadScheduler(debounce_s=0.2, min_interval_s=0.0, max_delay_s=1.0)
    s.changed(0.0)
    s.changed(0.9)
    assert s.take(1.0) == "change"
    s.changed(1.05)  # the writer goes on: a new burst, its maximum from here
    assert s.due_at() == pytest.approx(1.25)
    s.changed(1.2)
    s.changed(1.4)
    s.changed(1.6)
    s.changed(1.8)
    s.changed(2.0)
    assert s.due_at() == pytest.approx(2.05)
    assert s.take(2.05) == "change"


# ---------------------------------------------------------------- confirm


def test_confirm_new_worker_is_ok():
    before = parse_show_proc(show_proc(0, 0, 200))
    after = parse_show_proc(show_proc(1, 0, 201, old=((200, 1),)))
    assert confirm_reload(before, after) == "ok"


def test_confirm_same_worker_is_pending_until_the_master_reports():
    before = parse_show_proc(show_proc(0, 0, 200))
    assert confirm_reload(before, parse_show_proc(show_proc(0, 0, 200))) == "pending"


def test_confirm_failed_counter_growth_is_failed():
    # Seen on 2.6.12: a config that passes -c but cannot bind -> master `2 [failed: 1]`, same worker.
    before = parse_show_proc(show_proc(1, 0, 200))
    after = parse_show_proc(show_proc(2, 1, 200))
    assert confirm_reload(before, after) == "failed"


def test_confirm_second_failure_in_a_row_is_failed():
    before = parse_show_proc(show_proc(2, 1, 200))
    after = parse_show_proc(show_proc(3, 1, 200))
    assert confirm_reload(before, after) == "failed"


def test_confirm_success_after_failure_resets_failed_and_is_ok():
    # HAProxy resets `failed` to 0 when a load succeeds: "unchanged" must not be required.
    before = parse_show_proc(show_proc(2, 1, 200))
    after = parse_show_proc(show_proc(3, 0, 300, old=((200, 2),)))
    assert confirm_reload(before, after) == "ok"


def test_confirm_an_old_worker_becoming_current_is_not_a_new_worker():
    before = parse_show_proc(show_proc(1, 0, 201, old=((200, 1),)))
    after = parse_show_proc(show_proc(1, 0, 200))
    assert confirm_reload(before, after) == "pending"


def test_confirm_on_34_shape():
    before = parse_show_proc(
        "#<PID>          <type>          <reloads>       <uptime>        <version>\n"
        "1234            master          2 [failed: 0]   0d00h01m02s     3.4.0\n"
        "# workers\n1300            worker          0               0d00h00m05s     3.4.0\n"
    )
    after = parse_show_proc(
        "#<PID>          <type>          <reloads>       <uptime>        <version>\n"
        "1234            master          3 [failed: 0]   0d00h01m03s     3.4.0\n"
        "# workers\n1400            worker          0               0d00h00m00s     3.4.0\n"
        "# old workers\n1300            worker          1               0d00h00m06s     3.4.0\n"
    )
    assert confirm_reload(before, after) == "ok"


# Captured on 3.4.0 (3.2.0 alike) after a reload that could not bind: `# workers` is empty and the
# worker that still serves (`@!9425 show info`: Stopping: 0) is listed under `# old workers`.
FAILED_RELOAD_34 = (
    "#<PID>          <type>          <reloads>       <uptime>        <version>      \n"
    "9417            master          2 [failed: 1]   0d00h00m05s     3.4.0-64a335366\n"
    "# workers\n"
    "# old workers\n"
    "9425            worker          1               0d00h00m04s     3.4.0-64a335366\n"
    "9419            worker          2               0d00h00m06s     3.4.0-64a335366\n\n"
)


def test_the_serving_worker_listed_as_old_after_a_failed_reload_is_current():
    procs = parse_show_proc(FAILED_RELOAD_34)
    assert procs.current_worker is not None and procs.current_worker.pid == 9425
    assert [p.pid for p in procs.old_workers] == [9419], "only the one that really drains is old"


def test_a_failed_reload_on_34_is_failed_not_a_new_worker():
    before = parse_show_proc(
        "#<PID>          <type>          <reloads>       <uptime>        <version>\n"
        "9417            master          1 [failed: 0]   0d00h00m02s     3.4.0\n"
        "# workers\n9425            worker          0               0d00h00m01s     3.4.0\n"
        "# old workers\n9419            worker          1               0d00h00m03s     3.4.0\n"
    )
    after = parse_show_proc(FAILED_RELOAD_34)
    assert confirm_reload(before, after) == "failed"
    assert old_workers_over_max(after, 0) == [p for p in after.old_workers if p.pid == 9419]


# ---------------------------------------------------------------- old workers max


def test_old_workers_over_max_picks_the_oldest():
    procs = parse_show_proc(show_proc(3, 0, 400, old=((300, 1), (200, 2), (100, 3))))
    assert [p.pid for p in old_workers_over_max(procs, 1)] == [100, 200]
    assert [p.pid for p in old_workers_over_max(procs, 2)] == [100]
    assert old_workers_over_max(procs, 3) == []
    assert old_workers_over_max(procs, 50) == []


def test_old_workers_over_max_ties_go_by_pid():
    procs = parse_show_proc(show_proc(3, 0, 400, old=((310, 1), (305, 1))))
    assert [p.pid for p in old_workers_over_max(procs, 1)] == [305]


# ---------------------------------------------------------------- paths


def test_split_watch(tmp_path: Path):
    (tmp_path / "certs").mkdir()
    files, dirs = split_watch(tmp_path / "h.cfg", (tmp_path / "certs", tmp_path / "x.map"))
    assert files == [tmp_path / "h.cfg", tmp_path / "x.map"] and dirs == [tmp_path / "certs"]


def test_inputs_digest_changes_with_content_not_k8s_internals(tmp_path: Path):
    d = tmp_path / "maps"
    d.mkdir()
    (d / "a.map").write_text("k v\n")
    first = inputs_digest([d])
    (d / "..2024_01").mkdir()
    (d / "..2024_01" / "junk").write_text("whatever")
    assert inputs_digest([d]) == first
    (d / "a.map").write_text("k w\n")
    assert inputs_digest([d]) != first
    assert inputs_digest([]) == inputs_digest(())
    assert inputs_digest([tmp_path / "missing.map"]) != inputs_digest([])


def test_one_line_prefers_alerts():
    text = "[NOTICE] hello\n[ALERT] (1) : config : bad thing\n[ALERT] (1) : fatal\n"
    assert one_line(text) == "[ALERT] (1) : config : bad thing | [ALERT] (1) : fatal"
    assert one_line("plain") == "plain"
    assert one_line("x" * 1000, limit=20).endswith("...")


# ---------------------------------------------------------------- forced reloads and retries


def test_a_forced_reload_is_due_at_once_but_not_before_min_interval():
    s = ReloadScheduler(debounce_s=0.2, min_interval_s=1.0)
    s.forced = True
    assert s.take(0.0) == "forced"
    s.last_reload = 0.0
    s.forced = True
    s.forced = True  # a second request before the reload starts: the same reload
    assert s.take(0.5) is None
    assert s.take(1.0) == "forced"
    assert s.take(5.0) is None, "both requests were served by one reload"


def test_a_forced_reload_takes_a_pending_change_and_retry_with_it():
    s = ReloadScheduler(debounce_s=0.2, min_interval_s=0.0)
    s.changed(0.0)
    s.retry_at = 0.05
    s.forced = True
    assert s.take(0.01) == "forced"
    assert not s.pending and s.take(10.0) is None


@pytest.mark.parametrize(
    ("requests", "due"),
    [
        (("asked",), "asked"),
        (("asked", "asked"), "asked"),  # a second request before the cycle starts: the same cycle
        (("asked", "forced"), "forced"),  # a forced reload does all an asked cycle would, and more
        (("forced", "asked"), "forced"),
    ],
)
def test_an_asked_cycle_is_due_at_once_and_a_forced_reload_takes_it_with_it(requests, due):
    s = ReloadScheduler(debounce_s=10.0, min_interval_s=1.0, max_delay_s=20.0)
    s.last_reload = 0.0
    s.changed(0.5)  # a write the debounce would still hold
    for request in requests:
        setattr(s, request, True)
    assert s.take(0.9) is None, "not before min_interval"
    assert s.take(1.0) == due
    assert not s.pending and s.take(5.0) is None, "the change and every request were taken by one cycle"


def test_a_retry_waits_for_its_time_and_for_a_change_still_being_written():
    s = ReloadScheduler(debounce_s=0.2, min_interval_s=0.0)
    s.retry_at = 1.0
    assert s.take(0.9) is None
    s.changed(0.95)  # a write in progress: no retry may read it half-written
    assert s.take(1.0) is None
    assert s.take(1.15) == "change"
    assert not s.pending


def test_a_write_in_progress_is_pending_but_due_only_once_closed():
    s = ReloadScheduler(debounce_s=0.2, min_interval_s=0.0, max_delay_s=1.0)
    s.writing = True
    assert s.pending and s.due_at() is None, "nothing to read while the file is written"
    assert s.take(100.0) is None and s.pending
    s.changed(100.0)  # closed
    assert s.take(100.2) == "change"
    assert not s.pending


@pytest.mark.parametrize(
    ("retry_at", "now", "moved", "due"),
    [
        (15.0, 3.0, True, 3.0),  # waiting out its backoff: due now
        (3.0, 3.0, False, 3.0),  # due already
        (2.0, 3.0, False, 2.0),
        (None, 3.0, False, None),  # nothing to retry: nothing becomes due
    ],
)
def test_a_retry_waiting_out_its_backoff_is_due_when_the_master_cli_answers_again(retry_at, now, moved, due):
    s = ReloadScheduler(debounce_s=0.2, min_interval_s=0.0)
    s.retry_at = retry_at
    assert s.answered_again(now) is moved
    assert s.due_at() == due


def test_a_retry_honours_min_interval():
    s = ReloadScheduler(debounce_s=0.2, min_interval_s=2.0)
    s.last_reload = 0.0
    s.retry_at = 0.5
    assert s.due_at() == 2.0
    assert s.take(1.9) is None and s.take(2.0) == "retry"


def test_retry_delays_double_from_half_a_second_to_the_cap():
    assert [retry_delay(n, 30) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert retry_delay(1000, 30) == 30
    assert retry_delay(0, 0.2) == 0.2


def test_the_goal_is_run_only_with_the_same_config_and_watched_files():
    assert runs_goal(("a", "w"), ("a", "w"))
    assert not runs_goal(("a", "w"), ("b", "w"))
    assert not runs_goal(("a", "w"), ("a", None)), "unknown watched files are not the goal's"
    assert not runs_goal(None, ("a", "w"))
    assert not runs_goal(("a", "w"), None)
