"""Settings: defaults, paths, validation messages, environment gates."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.settings import SettingsError, load_settings, parse_bool


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    return path


def test_defaults_from_empty_file(tmp_path):
    s = load_settings(write(tmp_path, ""), environ={})
    assert s.reload.debounce_ms == 200 and s.reload.min_interval_ms == 1000 and s.reload.max_delay_ms == 1000
    assert s.old_workers.max == 50 and s.old_workers.guard and s.old_workers.no_backup == "fail-fast"
    assert not s.observe.enabled and s.observe.error_limit == 3
    assert s.status.listen == "127.0.0.1:9180"
    assert s.haproxy.master_socket_path == Path("/run/haproxy-supervisor/master.sock")


def test_relative_paths_are_relative_to_the_settings_file(tmp_path):
    s = load_settings(write(tmp_path, "haproxy:\n  config: r/h.cfg\n  watch: [maps]\n  runtime_dir: run\n"), environ={})
    assert s.haproxy.config == tmp_path / "r/h.cfg"
    assert s.haproxy.watch == (tmp_path / "maps",)
    assert s.haproxy.effective_config == tmp_path / "run/haproxy.cfg"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("reload:\n  debounce_ms: -5\n", "reload.debounce_ms: must be positive, got -5"),
        ("reload:\n  debounce_ms: 0\n", "reload.debounce_ms: must be positive, got 0"),
        ("reload:\n  max_delay_ms: 0\n", "reload.max_delay_ms: must be positive, got 0"),
        ("reload:\n  min_interval_ms: -1\n", "reload.min_interval_ms: must not be negative"),
        ("reload:\n  bogus: 1\n", "reload.bogus: unknown key"),
        ("nope: 1\n", "nope: unknown key"),
        ("reload:\n  runtime_apply: 'yes'\n", "reload.runtime_apply: must be true or false"),
        ("old_workers:\n  no_backup: drop\n", "old_workers.no_backup: must be one of fail-fast, keep"),
        ("old_workers:\n  max: 2.5\n", "old_workers.max: must be a whole number"),
        ("status:\n  listen: nowhere\n", "status.listen: must be host:port or unix:/path"),
        ("haproxy: [1, 2]\n", "haproxy: must be a mapping"),
        ("reload:\n  debounce_ms: [\n", "invalid YAML at line"),
        ("- a\n", "top level must be a mapping"),
        ("logging:\n  level: loud\n", "logging.level: must be one of"),
    ],
)
def test_bad_settings_name_file_key_and_problem(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SettingsError) as err:
        load_settings(path, environ={})
    assert str(path) in str(err.value)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(SettingsError, match="cannot read settings file"):
        load_settings(tmp_path / "absent.yaml", environ={})


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_truthy(value):
    assert parse_bool(value) is True


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF"])
def test_falsy(value):
    assert parse_bool(value) is False


def test_observe_gate_from_env_overrides_file(tmp_path):
    path = write(tmp_path, "observe:\n  enabled: false\n  error_limit: 7\n")
    s = load_settings(path, environ={"RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED": "yes"})
    assert s.observe.enabled and s.observe.error_limit == 7
    s = load_settings(path, environ={
        "HAPROXY_SUPERVISOR_OBSERVE_MARK_DOWN_ENABLED": "on",
        "HAPROXY_SUPERVISOR_OBSERVE_ERROR_LIMIT": "5",
    })
    assert s.observe.enabled and s.observe.error_limit == 5


def test_ray_variable_wins_over_alias(tmp_path):
    s = load_settings(write(tmp_path, ""), environ={
        "RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED": "0",
        "HAPROXY_SUPERVISOR_OBSERVE_MARK_DOWN_ENABLED": "1",
    })
    assert not s.observe.enabled


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED": "maybe"},
            "RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED='maybe'",
        ),
        ({"RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT": "0"}, "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT='0'"),
        ({"HAPROXY_SUPERVISOR_OBSERVE_ERROR_LIMIT": "-2"}, "must be a positive integer"),
        ({"HAPROXY_SUPERVISOR_OBSERVE_ERROR_LIMIT": "three"}, "HAPROXY_SUPERVISOR_OBSERVE_ERROR_LIMIT='three'"),
    ],
)
def test_bad_env_values(tmp_path, env, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        load_settings(write(tmp_path, ""), environ=env)
