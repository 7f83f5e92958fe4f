"""The hand-off's decisions: which backends are eligible, what the injection writes, which
backends an old worker hands off, the map changes it needs, and the hand-off server kept out
of every reader of servers."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from rigs.ray_driver import App, ray_config
from supervisor.effective import RenderedConfigError, build_effective, effective_config_and_table, sha256_text
from supervisor.haproxy.answers import parse_servers_state, servers_state_rows
from supervisor.haproxy.api import CLIError
from supervisor.haproxy.config import Config
from supervisor.haproxy.guard import GUARD_MARKER
from supervisor.haproxy.handoff import (
    HANDOFF_FRONTEND,
    HANDOFF_SERVER,
    accepted,
    eligible_backends,
    handed_off,
    handoff_entries,
    inject_handoff,
    is_handed_off,
    offered,
)
from supervisor.haproxy.runtime.plan import RuntimePlan, completed_plan, runtime_plan
from supervisor.settings import HAProxySettings, OldWorkerSettings, Settings
from supervisor.state import Generation, State
from supervisor.steering.handoff import HandOffs, handoff_changes
from tests.conftest import CORPUS

RUN = Path("/run/hs")
HEAD = """\
defaults
    mode http
    timeout client 1s
frontend fe
    bind :80
    default_backend app
"""


def settings(hand_off: bool = True, guard: bool = True) -> Settings:
    return Settings(
        haproxy=HAProxySettings(runtime_dir=RUN),
        old_workers=OldWorkerSettings(hand_off=hand_off, guard=guard),
    )


def effective(text: str, hand_off: bool = True, guard: bool = True) -> Config:
    return effective_config_and_table(Config.parse(text), settings(hand_off, guard))[0]


def body_of(config: Config, name: str) -> list[str]:
    section = next((s for s in config.backends() if s.name == name), None)
    assert section is not None
    return [line.raw.strip() for line in section.body if line.raw.strip()]


@pytest.mark.parametrize(
    ("section", "eligible"),
    [
        ("backend be\n    server a 127.0.0.1:1\n", True),
        ("listen be\n    bind :81\n    server a 127.0.0.1:1 check\n", True),
        ("backend be\n    balance leastconn\n    http-reuse always\n    server a 127.0.0.1:1 check\n", True),
        ("backend be\n    mode tcp\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    http-request set-header x 1\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    http-response set-header x 1\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    http-after-response set-header x 1\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    tcp-request content accept\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    tcp-response content accept\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    use-server a if { path /a }\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    option forwardfor\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    option originalto\n    server a 127.0.0.1:1\n", False),
        ("backend be\n    server a 127.0.0.1:1 backup\n", False),
        ("backend be\n", False),
        ("backend be\n    server a 127.0.0.1:1 proto h2 check\n", False),
        ("backend be\n    default-server proto h2\n    server a 127.0.0.1:1\n", False),
    ],
)
def test_which_backends_are_eligible(section, eligible):
    assert eligible_backends(Config.parse(HEAD + section)) == (["be"] if eligible else [])


def test_option_forwardfor_in_the_defaults_makes_its_backends_ineligible():
    text = (
        "defaults web\n    mode http\n    option forwardfor\n"
        "defaults plain\n    mode http\n"
        "backend by_web from web\n    server a 127.0.0.1:1\n"
        "backend by_plain\n    server a 127.0.0.1:1\n"
    )
    assert eligible_backends(Config.parse(text)) == ["by_plain"]


def test_no_backend_is_eligible_when_the_frontend_would_add_a_unique_id_header_again():
    text = (
        "defaults\n    mode http\n    unique-id-format %{+X}o%ci\n    unique-id-header x-request-id\n"
        "backend be\n    server a 127.0.0.1:1\n"
    )
    assert eligible_backends(Config.parse(text)) == []
    assert eligible_backends(Config.parse(text.replace("    unique-id-header x-request-id\n", ""))) == ["be"]


def test_rules_of_a_named_defaults_make_its_backends_ineligible():
    # They would run in both workers (HAProxy runs a defaults' rules before the proxy's own).
    text = (
        "defaults ruled\n    mode http\n    http-request set-header x-d 1\n"
        "defaults plain\n    mode http\n"
        "backend by_ruled from ruled\n    server a 127.0.0.1:1\n"
        "backend by_plain\n    server a 127.0.0.1:1\n"
    )
    assert eligible_backends(Config.parse(text)) == ["by_plain"]


def test_no_backend_is_eligible_when_the_frontend_would_inherit_rules_of_the_last_defaults():
    # HAProxy refuses a frontend and a backend under the same defaults with rules.
    text = "defaults ruled\n    mode http\n    tcp-request content accept\nbackend be\n    server a 127.0.0.1:1\n"
    assert eligible_backends(Config.parse(text)) == []


def test_no_backend_is_eligible_when_the_frontend_would_inherit_option_forwardfor():
    # The hand-off frontend goes last, under the last defaults: it would add X-Forwarded-For again.
    text = "defaults\n    mode http\nbackend be\n    server a 127.0.0.1:1\ndefaults\n    option forwardfor\n"
    assert eligible_backends(Config.parse(text)) == []


def test_ray_serve_app_backends_are_eligible():
    ray = Config.parse((CORPUS / "rayserve.cfg").read_text())
    eligible = eligible_backends(ray)
    assert {"echo", "highscale", "wide"} <= set(eligible)
    assert not {"echo_via_router", "highscale_via_router", "default_backend"} & set(eligible)
    assert not {"grpc_echo", "grpc_wide"} & set(eligible)  # HTTP/2 to their servers
    apps = [App("app1", ["127.0.0.1:18001", "127.0.0.1:18002"]), App("app2", ["127.0.0.1:18003"])]
    shaped = ray_config(RUN, 8000, 8001, 8002, apps, None)
    assert {"app1", "app2"} <= set(eligible_backends(Config.parse(shaped)))


def test_injection_writes_the_server_the_rules_and_the_frontend():
    app = "backend app\n    server a 127.0.0.1:1 check\n"
    text = HEAD + app + "backend ruled\n    http-request deny\n    server a 127.0.0.1:1\n"
    config = effective(text)
    body = body_of(config, "app")
    test = "{ be_name,map(/run/hs/handoff.map) -m found }"
    set_header = f"http-request set-header x-hs-backend %[be_name] if {test}"
    assert body.index(set_header) < body.index(GUARD_MARKER)  # before every rule of the guard
    use_servers = [line for line in body if line.startswith("use-server")]
    assert use_servers[0] == f"use-server {HANDOFF_SERVER} if {test}"
    assert len(use_servers) == 2  # then the guard's
    # The guard's refusal spares a handed-off request: the current worker has live servers.
    assert f"http-request return status 503 if {{ var(txn.hsv_n) -m int 0 }} !{test}" in body
    words = "weight 0 no-check no-ssl no-backup no-send-proxy send-proxy-v2"
    assert body[-1] == f"server {HANDOFF_SERVER} unix@/run/hs/handoff.sock {words}"
    ruled = next((s for s in config.backends() if s.name == "ruled"), None)
    assert ruled is not None and not is_handed_off(ruled)
    assert "http-request return status 503 if { var(txn.hsv_n) -m int 0 }" in body_of(config, "ruled")
    frontend = config.sections[-1]
    assert (frontend.kind, frontend.name) == ("frontend", HANDOFF_FRONTEND)
    assert [line.raw.strip() for line in frontend.body] == [
        "mode http",
        "bind unix@/run/hs/handoff.sock accept-proxy mode 600",
        "http-request set-var(txn.hs_backend) req.hdr(x-hs-backend)",
        "http-request del-header x-hs-backend",
        "use_backend %[var(txn.hs_backend)]",
    ]
    assert Config.parse(config.render()).render() == config.render()


def test_injection_without_the_guard_and_on_a_last_line_without_newline():
    config = effective(HEAD + "backend app\n    server a 127.0.0.1:1", guard=False)
    body = body_of(config, "app")
    assert body[0] == "server a 127.0.0.1:1"
    assert body[2].startswith("http-request set-header x-hs-backend")
    assert body[3].startswith("force-persist if ")
    assert body[6].startswith(f"use-server {HANDOFF_SERVER} ")
    assert body[7].startswith(f"server {HANDOFF_SERVER} ")
    assert config.render().endswith("use_backend %[var(txn.hs_backend)]\n")


TEST = "{ be_name,map(/run/hs/handoff.map) -m found }"


@pytest.mark.parametrize(
    ("defaults", "backend", "added"),
    [
        # HAProxy's own default is `retry-on conn-failure`: the close the current worker makes
        # is retried in the old worker only.
        ("", "", ["retry-on conn-failure empty-response", f"http-request disable-l7-retry unless {TEST}"]),
        ("    retry-on conn-failure\n", "", ["retry-on conn-failure empty-response",
                                           f"http-request disable-l7-retry unless {TEST}"]),
        ("    retry-on conn-failure\n", "    retry-on 503 conn-failure\n",
         ["retry-on 503 conn-failure empty-response", f"http-request disable-l7-retry unless {TEST}"]),
        ("    retry-on conn-failure empty-response response-timeout\n", "", []),  # retried already
        ("", "    retry-on all-retryable-errors\n", []),
        ("    retry-on none\n", "", []),  # no retry wanted
    ],
)
def test_the_rescue_retries_a_handed_off_request_the_current_worker_ended(defaults, backend, added):
    text = f"defaults\n    mode http\n{defaults}backend app\n{backend}    server a 127.0.0.1:1\n"
    body = body_of(effective(text, guard=False), "app")
    set_header = body.index(f"http-request set-header x-hs-backend %[be_name] if {TEST}")
    assert body[set_header + 1] == f"force-persist if {TEST}"
    assert [line for line in body if line.startswith(("retry-on", "http-request disable-l7-retry"))] == [
        *(line.strip() for line in backend.splitlines()), *added
    ]


def test_off_or_nothing_eligible_leaves_the_config_as_the_guard_made_it():
    text = HEAD + "backend app\n    mode tcp\n    server a 127.0.0.1:1\n"
    assert effective(text).render() == effective(text, hand_off=False).render()
    eligible = HEAD + "backend app\n    server a 127.0.0.1:1\n"
    assert HANDOFF_FRONTEND not in effective(eligible, hand_off=False).render()
    assert inject_handoff(Config.parse(eligible), [], RUN).render() == eligible


def test_the_slot_table_and_the_servers_never_see_the_hand_off_server():
    text = HEAD + "backend app\n    server a 127.0.0.1:1\n    server b 127.0.0.1:2\n"
    config, table = effective_config_and_table(Config.parse(text), settings())
    _, without = effective_config_and_table(Config.parse(text), settings(hand_off=False))
    assert table == without
    assert [s.name for s in config.servers()] == ["a", "b"]
    assert [len(lines) for _, lines in config.server_flags_by_backend()] == [2]
    again = Config.parse(config.render())  # as the generations book reads it back
    assert [s.key for s in again.servers()] == ["app/a", "app/b"]


def test_a_reserved_name_in_the_rendered_config_is_refused():
    text = HEAD + f"backend app\n    server {HANDOFF_SERVER} 127.0.0.1:1\n"
    with pytest.raises(RenderedConfigError, match=r"reserved for old_workers\.hand_off"):
        effective(text)
    with pytest.raises(RenderedConfigError, match=HANDOFF_FRONTEND):
        effective(HEAD + f"frontend {HANDOFF_FRONTEND}\n    bind :82\n")
    with pytest.raises(Exception, match="map"):
        inject_handoff(Config.parse(HEAD + "backend app\n    server a 127.0.0.1:1\n"), ["app"], Path("/run/two words"))


def test_show_servers_state_rows_leave_the_hand_off_server_out():
    answer = (
        "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_port\n"
        "2 app 1 a 127.0.0.1 2 0 1 8001\n"
        f"2 app 2 {HANDOFF_SERVER} /run/hs/handoff.sock 2 0 0 0\n"
        f"2 app 3 {HANDOFF_SERVER}x 127.0.0.1 2 0 1 8003\n"
    )
    assert [s.name for s in parse_servers_state(answer)] == ["a", f"{HANDOFF_SERVER}x"]
    rows = [row for block in servers_state_rows(answer, ("be_name",)) for row in block.rows]
    assert len(rows) == 2


OLD = HEAD + (
    "backend app\n    server a 127.0.0.1:1\n"
    "backend gone\n    server a 127.0.0.1:1\n"
    "backend moded\n    server a 127.0.0.1:1\n"
    "backend ruled\n    http-request deny\n    server a 127.0.0.1:1\n"
)


def test_an_old_worker_hands_off_what_both_configs_have_in_the_same_mode():
    current = HEAD + (
        "backend app\n    http-request set-header x 1\n    server c 127.0.0.1:3\n"  # a rule now: still taken
        "backend moded\n    mode tcp\n    server c 127.0.0.1:3\n"
        "backend ruled\n    server c 127.0.0.1:3\n"
        "backend spare\n    server c 127.0.0.1:3\n"
    )
    old, new = effective(OLD), effective(current)
    assert handed_off(offered(old), accepted(new)) == ["app"]
    assert handoff_entries(handed_off(offered(old), accepted(new))) == {"app": "1"}
    # A current config without the hand-off frontend takes nothing.
    assert handed_off(offered(old), accepted(effective(current, hand_off=False))) == []


def test_handoff_changes_add_what_is_missing_and_remove_what_is_not_wanted():
    changes = handoff_changes({"app": "1", "gone": "1"}, {"app": "1", "new": "1"})
    assert (changes.adds, changes.sets, changes.dels) == ((("new", "1"),), (), ("gone",))
    assert not handoff_changes({"app": "1"}, {"app": "1"})


class MapCLI:
    """Each worker's hand-off map, changed by `add map` payloads and `del map` commands; raises
    `failing` while it is set."""

    def __init__(self) -> None:
        self.maps: dict[int, dict[str, str]] = {}
        self.failing: CLIError | None = None
        self.sent = 0

    async def execute(self, line: str, timeout: float | None = None) -> str:
        if self.failing is not None:
            raise self.failing
        head, _, payload = line.partition("\n")
        commands = head.split(";")
        for command in commands:
            words = command.split()
            pid, verb = int(words[0].removeprefix("@!")), words[1:3]
            held = self.maps.setdefault(pid, {})
            if verb == ["show", "map"]:
                return "".join(f"0x1 {k} {v}\n" for k, v in held.items()) + "\n"
            self.sent += 1
            if verb == ["add", "map"]:
                held.update(entry.split() for entry in payload.splitlines() if entry)
            elif verb == ["del", "map"]:
                held.pop(words[4], None)
        return "\n" * len(commands)

    async def on(self, pid: int, command: str, timeout: float | None = None) -> str:
        return await self.execute(f"@!{pid} {command}", timeout)


def generation(number: int, text: str) -> Generation:
    model = effective(text)
    return Generation(number, model, sha256_text(model.render()), "", datetime.now(UTC), 100 + number)


async def test_each_old_worker_gets_its_entries_once_and_a_failure_is_tried_again():
    state, cli = State(), MapCLI()
    handoffs = HandOffs(settings(), state, cli)  # type: ignore[arg-type]
    old, current = generation(1, OLD), generation(2, OLD.replace("backend gone\n", "backend gone\n    mode tcp\n"))
    state.publish_old_workers({101: 1}, {101: None})
    cli.failing = CLIError("connection refused")
    await handoffs.round({101: old}, current)
    assert state.old_workers[101].handed_off == 0
    cli.failing = None
    await handoffs.round({101: old}, current)  # the next round tries again
    assert cli.maps[101] == {"app": "1", "moded": "1"}
    assert state.old_workers[101].handed_off == 2
    sent = cli.sent
    await handoffs.round({101: old}, current)
    assert cli.sent == sent  # confirmed: nothing asked again
    # The current config loses `moded`: its entry leaves the old worker's map.
    later = generation(3, OLD.replace("backend moded\n", "backend moded\n    mode tcp\n"))
    await handoffs.round({101: old}, later)
    assert cli.maps[101] == {"app": "1", "gone": "1"}


async def test_a_backend_the_upcoming_config_lacks_is_handed_off_no_more_before_the_reload():
    state, cli = State(), MapCLI()
    handoffs = HandOffs(settings(), state, cli)  # type: ignore[arg-type]
    old, current = generation(1, OLD), generation(2, OLD)
    state.publish_old_workers({101: 1}, {101: None})
    await handoffs.round({101: old}, current)
    assert cli.maps[101] == {"app": "1", "gone": "1", "moded": "1"}
    text = OLD.replace("backend gone\n    server a 127.0.0.1:1\n", "")
    upcoming = build_effective(settings(), text)
    await handoffs.round({101: old}, current, upcoming)
    assert cli.maps[101] == {"app": "1", "moded": "1"}
    assert state.old_workers[101].handed_off == 2


def test_a_runtime_change_never_adds_or_removes_the_hand_off_server():
    before = effective(HEAD + "backend app\n    server a 127.0.0.1:1\n")
    after = effective(HEAD + "backend app\n    server a 127.0.0.1:1\n    server b 127.0.0.1:2\n")
    plan = runtime_plan(before, after)
    assert plan.changes == [] and [a.key for a in plan.adds] == ["app/b"] and plan.removes == ()
    # What the worker holds, read back: the hand-off server is no server it would remove.
    held = parse_servers_state(
        "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_port\n"
        "2 app 1 a 127.0.0.1 2 0 1 1\n"
        f"2 app 2 {HANDOFF_SERVER} /run/hs/handoff.sock 2 0 0 0\n"
    )
    completed = completed_plan(plan, held, after)
    assert isinstance(completed, RuntimePlan) and completed.removes == ()
