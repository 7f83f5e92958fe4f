"""A steered old worker's retry that meets a second black-holed server, the daemon knowing both
dead (tests/support/retry_abort.py): with the detector's abort, the connects toward them are
destroyed at first sight and the requests answered at once; the control, with the abort off,
pays `timeout connect` for each dead server met. A request whose every attempt (`retries 3`)
meets a dead server still ends in HAProxy's 503 (a redispatch avoids only the server it failed
on), but at once; with `observe` on the servers (Ray's default), the old worker marks each dead
server down after its error limit of aborted connects, and none does."""

from __future__ import annotations

from rigs.netns import needs_netns, run_in_netns
from tests.support.retry_abort import CONNECT_TIMEOUT_S, RETRIES, run_staged

pytestmark = needs_netns


def test_connects_to_known_dead_servers_in_a_steered_old_worker_are_aborted_at_once():
    found = run_in_netns(run_staged, abort=True, timeout=120)
    answers = found["answers"]
    assert found["effective_redispatch"] == ["option redispatch 1"], found
    assert all(body == "r3" for status, body, _ in answers if status == 200), found
    assert sum(status == 200 for status, _, _ in answers) >= len(answers) - 2, found
    assert all(status in (200, 503) for status, _, _ in answers), found
    assert max(seconds for _, _, seconds in answers) < 1.0, found
    assert any("aborted (known dead)" in line for line in found["destroyed"]), found


def test_control_without_the_abort_a_connect_to_a_dead_server_waits_for_timeout_connect():
    found = run_in_netns(run_staged, abort=False, timeout=120)
    answers = found["answers"]
    assert found["effective_redispatch"] == ["option redispatch 1"], found
    assert max(seconds for _, _, seconds in answers) >= CONNECT_TIMEOUT_S - 0.1, found
    assert found["destroyed"] == [], found


def test_with_observe_an_old_worker_marks_the_aborted_servers_down_and_no_request_fails():
    found = run_in_netns(run_staged, abort=True, observe=True, timeout=120)
    answers = found["answers"]
    assert found["observed"] == 3, found
    assert [status for status, _, _ in answers] == [200] * len(answers), found
    assert all(body == "r3" for _, body, _ in answers), found
    # Once the old worker has one active server left, HAProxy waits min(1 s, timeout connect)
    # before each retry: `retries` of those at most, where the control pays timeout connect each.
    assert max(seconds for _, _, seconds in answers) < RETRIES * 1.0 + 0.5, found
    assert any("aborted (known dead)" in line for line in found["destroyed"]), found
