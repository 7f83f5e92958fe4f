"""contrib/: the Prometheus alert rules and the Grafana dashboard.

The rules pass `promtool check rules` and their unit tests (`promtool test rules`, one case per
alert, each with a case where it must not fire); the dashboard's queries are valid PromQL;
each alert links to a section of docs/runbook.md; and every metric the rules and the
dashboard name is exported by a running daemon, with the real HAProxy.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rigs.daemon import DaemonSupervised, tagged_config
from rigs.harness import ROOT, backends, free_port

RULES = ROOT / "contrib" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "contrib" / "prometheus" / "alerts.test.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "haproxy-supervisor.json"
RUNBOOK = ROOT / "docs" / "runbook.md"

# A metric name in PromQL, optionally with an exact label matcher right after it.
METRIC = re.compile(r"\b((?:haproxy_supervisor|process)_[a-z0-9_]+)\b(?:\{([^}]*)\})?")
EXACT_MATCHER = re.compile(r'(\w+)="([^"$]*)"')


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        raise RuntimeError("promtool is not installed: run `make test-deps` (it unpacks Debian's prometheus package)")
    return found


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def used_metrics(expressions: list[str]) -> dict[str, set[tuple[str, str]]]:
    """Metric name -> the exact `label="value"` matchers it is used with."""
    used: dict[str, set[tuple[str, str]]] = {}
    for expression in expressions:
        for name, matchers in METRIC.findall(expression):
            used.setdefault(name, set()).update(EXACT_MATCHER.findall(matchers or ""))
    return used


def exported_series(metrics_text: str) -> dict[str, list[dict[str, str]]]:
    """Every sample name in an exposition, with each sample's labels; families named by their
    HELP/TYPE lines count too (a gauge with no value yet has no sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[str, list[dict[str, str]]] = {}
    for line in metrics_text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            series.setdefault(line.split()[2], [])
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample.labels)
    return series


def missing_metrics(used: dict[str, set[tuple[str, str]]], exported: dict[str, list[dict[str, str]]]) -> list[str]:
    missing = []
    for name, matchers in sorted(used.items()):
        if name not in exported:
            missing.append(name)
            continue
        for label, value in sorted(matchers):
            if not any(labels.get(label) == value for labels in exported[name]):
                missing.append(f'{name}{{{label}="{value}"}}')
    return missing


def run_promtool(*args: str | Path, cwd: Path) -> str:
    done = subprocess.run([promtool(), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_rules_pass_promtool_check():
    out = run_promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_rules_pass_their_unit_tests_with_a_case_per_alert():
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert tested == {rule["alert"] for rule in alert_rules()}
    run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)


def test_a_broken_rule_fails_its_unit_test(tmp_path):
    """The control: the unit tests catch a rule that fires too early."""
    broken = RULES.read_text().replace("haproxy_supervisor_push_failures_total[2m]) > 0\n        for: 5m",
                                       "haproxy_supervisor_push_failures_total[2m]) > 0")
    assert broken != RULES.read_text()
    (tmp_path / RULES.name).write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    done = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "HAProxySupervisorPushFailing" in done.stdout + done.stderr


def test_dashboard_queries_are_valid_promql(tmp_path):
    # promtool parses PromQL when it checks rules: each query becomes a recording rule, with
    # Grafana's variables given values.
    rules = [
        {"record": f"dashboard:query{i}", "expr": query.replace("$__rate_interval", "5m").replace("$", "")}
        for i, query in enumerate(dashboard_queries())
        if not query.startswith("label_values(")
    ]
    assert len(rules) >= 10
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool("check", "rules", "dashboard.yml", cwd=tmp_path)


def test_every_alert_links_to_its_runbook_section():
    headings = {
        re.sub(r"[^a-z0-9 _-]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("#")
    }
    for rule in alert_rules():
        url = rule["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/runbook.md", url
        assert anchor in headings, f"{rule['alert']}: no section #{anchor} in docs/runbook.md"
        assert anchor == rule["alert"].lower()


def test_missing_metric_is_reported():
    """The control for the check below: a name or a label value the daemon does not export."""
    exported = exported_series(
        '# HELP haproxy_supervisor_reloads_total x\n# TYPE haproxy_supervisor_reloads_total counter\n'
        'haproxy_supervisor_reloads_total{result="ok"} 1.0\n'
    )
    used = used_metrics([
        'increase(haproxy_supervisor_reloads_total{result="ok"}[5m])',
        'increase(haproxy_supervisor_reloads_total{result="bogus"}[5m])',
        "haproxy_supervisor_pushes_failing",
    ])
    assert missing_metrics(used, exported) == [
        "haproxy_supervisor_pushes_failing", 'haproxy_supervisor_reloads_total{result="bogus"}',
    ]


@pytest.mark.haproxy
async def test_every_metric_of_the_rules_and_the_dashboard_is_exported_by_a_running_daemon(make):
    expressions = [rule["expr"] for rule in alert_rules()] + dashboard_queries()
    used = used_metrics(expressions)
    assert len(used) >= 12, sorted(used)
    with backends("b1") as started:
        daemon = make(tagged_config(free_port(), started["b1"].address, "g1"))
        daemon.start()
        await daemon.wait_generation(1)
        status, text = await DaemonSupervised(daemon).request("/metrics")
    assert status == 200
    assert missing_metrics(used, exported_series(text)) == []
