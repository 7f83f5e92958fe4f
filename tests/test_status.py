"""Pure parts of status: the /status document, metrics from State, the page, the CLI's table."""

from __future__ import annotations

import re
import stat
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rigs.status_state import CURRENT_PID, MASTER_PID, OLD_PIDS, running_state
from supervisor import __version__
from supervisor.settings import Settings
from supervisor.state import State
from supervisor.status.document import metrics_registry, not_ready_reason, status_document
from supervisor.status.listener import StatusServerError, bind_unix_socket
from supervisor.status.routes import load_token
from supervisor.statusclient import StatusFetchError, format_status, status_target, url_from_listen

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
STATUS_DOC = Path(__file__).resolve().parents[1] / "docs" / "status.md"
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Dotted leaf paths of a JSON document; a list of objects contributes `name[].leaf`."""
    if isinstance(value, dict):
        paths: set[str] = set()
        for key, item in value.items():
            paths |= key_paths(item, f"{prefix}.{key}" if prefix else key)
        return paths
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return set().union(*(key_paths(item, f"{prefix}[]") for item in value))
    return {prefix}


def documented_schema_keys() -> set[str]:
    text = STATUS_DOC.read_text()
    section = text.split("\n## The /status document\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_.\[\]0-9]+)` \|", section, flags=re.M))


def test_status_document_has_exactly_the_documented_keys():
    documented = documented_schema_keys()
    assert len(documented) > 30  # the table was found and read
    assert key_paths(status_document(running_state(NOW), Settings(), NOW)) == documented


def test_status_document_of_a_fresh_daemon_keeps_the_same_shape():
    document = status_document(State(started_at=NOW), Settings(), NOW)
    assert document["worker"] == {
        "pid": None, "generation": None, "config_sha256": None, "rendered_sha256": None, "started_at": None,
    }
    assert document["old_workers"] == []
    assert document["reloads"]["last"] is None and document["reloads"]["recent"] == []
    assert set(document) == {
        "supervisor", "haproxy", "worker", "old_workers", "reloads", "config", "convergence", "observe",
        "dead_servers", "operator_dead", "pending_removals", "suspect_servers", "detector", "writes",
    }
    assert document["writes"] == {"failing": [], "failures": 0}
    # Paths come from the settings; the binary falls back to them until the daemon has filled State in.
    assert document["config"]["rendered_path"] == "/etc/haproxy/rendered/haproxy.cfg"
    assert document["config"]["effective_path"] == "/run/haproxy-supervisor/haproxy.cfg"
    assert document["haproxy"]["binary"] == "haproxy"
    assert document["supervisor"]["ready"] is False and document["haproxy"]["up"] is False


def test_status_document_values():
    state = running_state(NOW)
    doc = status_document(state, Settings(), NOW)
    assert doc["supervisor"] == {"pid": state.supervisor_pid, "version": __version__, "uptime_s": 3723.0,
                                 "ready": True}
    assert doc["haproxy"] == {"version": "2.6.12-1+deb12u1", "master_pid": MASTER_PID,
                              "binary": "/usr/sbin/haproxy", "up": True}
    assert doc["worker"] == {
        "pid": CURRENT_PID, "generation": 3, "config_sha256": state.generations[3].effective_sha256,
        "rendered_sha256": state.generations[3].rendered_sha256, "started_at": "2025-01-02T03:03:45.000Z",
    }
    oldest, newer = doc["old_workers"]
    assert [oldest["pid"], newer["pid"]] == list(OLD_PIDS)  # oldest first
    # What each old worker runs, by the rendered config's sha256 (what the Ray bridge compares).
    assert [oldest["rendered_sha256"], newer["rendered_sha256"]] == [
        state.generations[1].rendered_sha256, state.generations[2].rendered_sha256,
    ]
    assert oldest["age_s"] == 2400.0 and newer["age_s"] == 180.0
    assert newer["steered"] == ["echo/echo_r1", "highscale/highscale_r2"]
    assert newer["push"] == {"state": "failed", "at": "2025-01-02T03:04:03.000Z",
                             "error": "master CLI /run/x/master.sock: timed out"}
    assert oldest["push"]["error"] is None
    reloads = doc["reloads"]
    assert {k: reloads[k] for k in ("ok", "failed", "invalid", "skipped_unchanged", "runtime_applied")} == {
        "ok": 3, "failed": 1, "invalid": 1, "skipped_unchanged": 1, "runtime_applied": 1,
    }
    assert reloads["last"] == {"at": "2025-01-02T03:03:45.000Z", "result": "ok", "duration_ms": 190.0, "error": None}
    assert [r["result"] for r in reloads["recent"]] == [
        "ok", "failed", "skipped_unchanged", "runtime_applied", "ok", "invalid", "ok",
    ]
    assert doc["dead_servers"] == ["app/app1", "echo/echo_r1", "highscale/highscale_r2"]
    assert doc["operator_dead"] == ["highscale/highscale_r2"]
    assert doc["observe"] == {"enabled": False, "error_limit": 3}  # from the settings, env gates applied


def test_every_time_in_the_document_is_rfc3339_utc():
    doc = status_document(running_state(NOW), Settings(), NOW)
    times = [doc["worker"]["started_at"], doc["reloads"]["last"]["at"]]
    times += [r["at"] for r in doc["reloads"]["recent"]] + [w["push"]["at"] for w in doc["old_workers"]]
    assert len(times) == 11
    for value in times:
        assert RFC3339_UTC.match(value), value
        assert datetime.fromisoformat(value).tzinfo == UTC


def test_not_ready_reasons():
    state = running_state(NOW)
    assert not_ready_reason(state) is None
    state.last_good_sha256 = "0" * 64
    assert not_ready_reason(state) == "the current worker does not run the last good config"
    state.publish_generation(replace(state.generations[3], worker_pid=None))
    assert not_ready_reason(state) == "no current worker yet"
    state.master_up = False
    assert not_ready_reason(state) == "HAProxy master is not running"


def test_not_ready_once_unconverged_for_longer_than_the_grace_period_unless_the_config_is_the_problem():
    state = running_state(NOW)
    state.convergence.reached()
    assert not_ready_reason(state, grace_s=60, now=NOW) is None
    state.convergence.missed("reload failed: show proc: no answer", transient=True, now=NOW)
    assert not_ready_reason(state, grace_s=60, now=NOW + timedelta(seconds=59)) is None
    reason = not_ready_reason(state, grace_s=60, now=NOW + timedelta(seconds=61))
    assert reason == "not converged for 61s (reload.converge_grace_s=60): reload failed: show proc: no answer"
    state.convergence.missed("the rendered config is invalid: bad", transient=False)
    assert not_ready_reason(state, grace_s=60, now=NOW + timedelta(hours=1)) is None
    state.master_socket_ok = False
    assert "socket is missing" in (not_ready_reason(state) or "")


def test_convergence_in_status_and_metrics():
    state = running_state(NOW)
    state.convergence.reached()
    state.convergence.missed("a change is pending", transient=True, now=NOW - timedelta(seconds=90))
    doc = status_document(state, Settings(), NOW)
    assert doc["convergence"] == {
        "converged": False, "unconverged_s": 90.0, "since": "2025-01-02T03:02:35.000Z",
        "reason": "a change is pending", "transient": True, "attempts": 0, "next_attempt_at": None,
    }
    assert doc["supervisor"]["ready"] is False  # 90 s > the default grace of 60 s
    def value(name: str) -> float:
        return scrape(state)[name].samples[0].value

    assert value("haproxy_supervisor_converged") == 0
    assert value("haproxy_supervisor_unconverged_seconds") == 90
    state.convergence.reached()
    assert value("haproxy_supervisor_converged") == 1 and value("haproxy_supervisor_unconverged_seconds") == 0


# ---------------------------------------------------------------- metrics


def scrape(state: State) -> dict[str, Any]:
    text = generate_latest(metrics_registry(state, lambda: NOW)).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], name: str, labels: dict[str, str] | None = None) -> float:
    family_name = re.sub(r"(_total|_bucket|_sum|_count)$", "", name)
    for s in families[family_name].samples:
        if s.name == name and s.labels == (labels or {}):
            return s.value
    raise AssertionError(f"no sample {name}{labels or ''}")


def test_metrics_from_a_running_state():
    families = scrape(running_state(NOW))
    assert sample(families, "haproxy_supervisor_up") == 1
    assert sample(families, "haproxy_supervisor_ready") == 1
    for result, count in {"ok": 3, "failed": 1, "invalid": 1, "skipped_unchanged": 1, "runtime_applied": 1}.items():
        assert sample(families, "haproxy_supervisor_reloads_total", {"result": result}) == count
    assert sample(families, "haproxy_supervisor_runtime_applies_total") == 1
    assert sample(families, "haproxy_supervisor_config_generation") == 3
    assert sample(families, "haproxy_supervisor_old_workers") == 2
    assert sample(families, "haproxy_supervisor_old_worker_oldest_age_seconds") == 2400
    assert sample(families, "haproxy_supervisor_old_worker_connections") == 15
    assert sample(families, "haproxy_supervisor_old_worker_rss_bytes") == 89 * 1024 * 1024
    assert sample(families, "haproxy_supervisor_steered_servers") == 3
    assert sample(families, "haproxy_supervisor_dead_servers") == 3
    assert sample(families, "haproxy_supervisor_push_failures_total") == 2
    assert sample(families, "haproxy_supervisor_master_restarts_total") == 1
    assert families["haproxy_supervisor_push_duration_seconds"].type == "histogram"
    assert families["haproxy_supervisor_reloads"].type == "counter"
    assert families["haproxy_supervisor_old_workers"].type == "gauge"
    assert "haproxy_supervisor_old_workers_max" not in families  # only where the cap is known
    # The daemon's own process metrics come along from the same private registry.
    assert sample(families, "process_resident_memory_bytes") > 0


def test_the_old_workers_cap_is_exported_for_the_piling_up_alert():
    text = generate_latest(metrics_registry(running_state(NOW), lambda: NOW, old_workers_max=8)).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert sample(families, "haproxy_supervisor_old_workers_max") == 8


def test_push_duration_histogram_is_cumulative():
    families = scrape(running_state(NOW))  # observed 0.003, 0.02, 0.02, 0.2, 3.0
    bucket = "haproxy_supervisor_push_duration_seconds_bucket"
    assert sample(families, bucket, {"le": "0.005"}) == 1
    assert sample(families, bucket, {"le": "0.025"}) == 3
    assert sample(families, bucket, {"le": "0.25"}) == 4
    assert sample(families, bucket, {"le": "2.5"}) == 4
    assert sample(families, bucket, {"le": "5.0"}) == 5
    assert sample(families, bucket, {"le": "+Inf"}) == 5
    assert sample(families, "haproxy_supervisor_push_duration_seconds_count") == 5
    assert sample(families, "haproxy_supervisor_push_duration_seconds_sum") == pytest.approx(3.243)


def test_metrics_of_a_fresh_daemon():
    families = scrape(State())
    assert sample(families, "haproxy_supervisor_up") == 0
    assert sample(families, "haproxy_supervisor_old_workers") == 0
    assert sample(families, "haproxy_supervisor_old_worker_oldest_age_seconds") == 0
    assert sample(families, "haproxy_supervisor_push_duration_seconds_bucket", {"le": "+Inf"}) == 0
    # No generation yet: the family is described but has no sample (rather than a made-up 0).
    assert families["haproxy_supervisor_config_generation"].samples == []


def test_metrics_registries_are_private():
    # Two daemons' states in one process (as in tests) must not share or clash.
    first, second = running_state(NOW), State()
    assert sample(scrape(first), "haproxy_supervisor_old_workers") == 2
    assert sample(scrape(second), "haproxy_supervisor_old_workers") == 0


# ---------------------------------------------------------------- the CLI's side


def test_status_table_names_the_first_steered_servers_of_a_big_drain():
    state = running_state(NOW)
    many = [f"be/srv{i:05d}" for i in range(5000)]
    state.old_workers[OLD_PIDS[0]].steered = many
    state.dead_servers = set(many)
    table = format_status(status_document(state, Settings(), NOW))
    assert "be/srv00009 (+4990 more)" in table and "be/srv00049 (+4950 more)" in table


def test_format_status_table():
    text = format_status(status_document(running_state(NOW), Settings(), NOW))
    lines = text.splitlines()
    assert lines[0].startswith(f"supervisor  {__version__}  pid ") and lines[0].endswith("ready")
    assert f"master pid {MASTER_PID}" in lines[1]
    assert f"pid {CURRENT_PID}  generation 3" in lines[2]
    header = next(i for i, line in enumerate(lines) if line.startswith("  PID "))
    assert lines[header - 1] == "old workers (2)"
    oldest, newer = lines[header + 1].split(), lines[header + 2]
    assert oldest[:4] == [str(OLD_PIDS[0]), "1", "40m", "00s"]
    assert newer.split()[7:] == ["failed", "echo/echo_r1,", "highscale/highscale_r2"]
    assert f"  push to {OLD_PIDS[1]} failed: master CLI /run/x/master.sock: timed out" in lines
    assert any(line.split()[1:3] == ["failed", "30.0"] for line in lines)
    assert "reloads     ok 3  failed 1  invalid 1  skipped_unchanged 1  runtime_applied 1" in lines
    assert lines[-1] == "dead servers (3): app/app1, echo/echo_r1, highscale/highscale_r2 (operator)"


def test_format_status_of_a_fresh_daemon():
    text = format_status(status_document(State(started_at=NOW), Settings(), NOW))
    assert "NOT READY" in text and "MASTER DOWN" in text and "old workers (0)\n  none" in text


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("127.0.0.1:9180", "http://127.0.0.1:9180"),
        ("0.0.0.0:9181", "http://127.0.0.1:9181"),
        ("[::]:9182", "http://[::1]:9182"),
        ("[::1]:9183", "http://[::1]:9183"),
        ("unix:/run/hs/status.sock", "unix:/run/hs/status.sock"),
    ],
)
def test_url_from_listen(listen, url):
    assert url_from_listen(listen) == url


def test_status_target():
    assert status_target("http://127.0.0.1:9180") == ("http://127.0.0.1:9180/status", None)
    assert status_target("http://127.0.0.1:9180/") == ("http://127.0.0.1:9180/status", None)
    assert status_target("http://h:1/status") == ("http://h:1/status", None)
    assert status_target("unix:/run/x.sock") == ("http://localhost/status", "/run/x.sock")
    assert status_target("unix:///run/x.sock") == ("http://localhost/status", "/run/x.sock")
    for bad in ("unix:", "ftp://h/", "127.0.0.1:9180"):
        with pytest.raises(StatusFetchError):
            status_target(bad)


# ---------------------------------------------------------------- token and socket


def test_load_token(tmp_path, caplog):
    assert load_token(None) == (None, "no status.token_file is configured: POST and DELETE are refused over TCP")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    token_file.chmod(0o600)
    assert load_token(token_file) == (b"s3cret", "")
    token_file.write_text("  \n")
    assert load_token(token_file)[0] is None
    missing = tmp_path / "missing"
    token, reason = load_token(missing)
    assert token is None and str(missing) in reason
    assert f"status.token_file {missing}: cannot read" in caplog.text
    token_file.write_text("s3cret")
    token_file.chmod(0o644)
    assert load_token(token_file)[0] == b"s3cret"
    assert "readable by every user" in caplog.text


def test_unix_socket_mode_and_stale_file(rundir):
    path = rundir / "status.sock"
    sock = bind_unix_socket(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        sock.listen()
        with pytest.raises(StatusServerError, match="another process is listening"):
            bind_unix_socket(path)
    finally:
        sock.close()
    # Closed without unlinking, like a daemon that was killed: the stale file is replaced.
    assert path.exists()
    again = bind_unix_socket(path)
    again.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o660


def test_unix_socket_refuses_to_replace_a_regular_file(rundir):
    path = rundir / "status.sock"
    path.write_text("not a socket")
    with pytest.raises(StatusServerError, match="not a socket"):
        bind_unix_socket(path)
    assert path.read_text() == "not a socket"



def test_suspects_in_status_metrics_and_page_with_why_since_and_left_in():
    from supervisor.page import BackendSizes, page_of
    from supervisor.state import SuspectServer

    state = running_state(NOW)
    since = NOW - timedelta(seconds=3)
    state.publish_suspects({
        "app/app1": SuspectServer("app/app1", "127.0.0.1:9001", "connect", since),
        "echo/echo_r1": SuspectServer("echo/echo_r1", "127.0.0.1:9002", "retransmit", since, left_in=True),
    })
    doc = status_document(state, Settings(), NOW)
    assert [(s["server"], s["why"], s["left_in"], s["suspect_s"]) for s in doc["suspect_servers"]] == [
        ("app/app1", "connect", False, 3.0), ("echo/echo_r1", "retransmit", True, 3.0)]
    families = scrape(state)
    assert sample(families, "haproxy_supervisor_suspect_servers", {"why": "connect"}) == 1
    assert sample(families, "haproxy_supervisor_suspect_servers", {"why": "retransmit"}) == 1  # left in, counted
    html = page_of(state, doc, NOW, BackendSizes())
    assert "connect stalled (SYN-SENT)</td>" in html
    assert "data sent, not acknowledged; left in: its backend has no other way</td>" in html
