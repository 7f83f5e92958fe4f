"""Servers added and removed by name, the applier's decisions against a scripted master CLI: its
fallbacks when HAProxy refuses (`del server` retried, added servers deleted, experimental mode),
and a change completed by what the worker already holds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from supervisor.haproxy.config import Config
from supervisor.haproxy.runtime.plan import runtime_plan
from tests.test_membership_plan import RAY, edit

# ---------------------------------------------------------------- the applier's fallbacks (a scripted CLI)


class ScriptedCLI:
    """Answers master-CLI lines by command, as HAProxy 2.6 words them; records what was sent.
    Only for the applier's own decisions: what HAProxy does is tested in test_membership_e2e."""

    def __init__(self, answers: dict[str, str], experimental: str | None = None) -> None:
        self.answers = answers
        self.experimental = experimental  # what `add server` answers outside experimental mode
        self.sent: list[str] = []

    async def execute(self, line: str, timeout: float | None = None) -> str:
        out = []
        mode = False
        for command in line.split(";"):
            if command == "experimental-mode on":  # the master session's mode, for this line
                mode = True
                self.sent.append(command)  # prints nothing at all (tests/captured/answers_*.txt)
                continue
            command = command.split(" ", 1)[1]  # drop `@!<pid>`
            self.sent.append(command)
            word = next((k for k in self.answers if command.startswith(k)), "")
            text = self.answers.get(word, "")
            if self.experimental and command.startswith("add server") and not mode:
                text = self.experimental
            out.append(f"{text}\n\n" if text else "\n")  # each answer ends with an empty line
        return "".join(out)


@pytest.fixture
def replaced():
    old = Config.parse(RAY)
    new = Config.parse(edit(RAY, "server app1_r1 127.0.0.1:9001 check", "server app1_r3 127.0.0.1:9003 check"))
    return old, new


ATTACHED = "Server still has connections attached to it, cannot remove it."


async def test_without_background_removals_a_del_server_refused_to_the_end_reloads(replaced, monkeypatch):
    import supervisor.haproxy.runtime.apply as apply
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    monkeypatch.setattr(apply, "AFTER_SHUTDOWN_S", 0.2)
    old, new = replaced
    cli = ScriptedCLI({"add server": "New server registered.", "del server": ATTACHED})
    current = SimpleNamespace(model=old, worker_pid=42)
    applier = RuntimeApplier(cli, remove_wait_s=0.1, background=False)
    outcome = await applier(current, new)
    assert outcome.applied is False
    assert outcome.runs is new  # the added server is in service: the worker runs it
    assert "shutdown sessions server app1/app1_r1" in cli.sent
    assert cli.sent.index("set server app1/app1_r3 state ready") < cli.sent.index("set server app1/app1_r1 state maint")


async def test_a_del_server_refused_leaves_a_pending_removal_retried_until_deleted(replaced, monkeypatch):
    import supervisor.haproxy.runtime.hook as pending
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    monkeypatch.setattr(pending, "RETRY_MAX_S", 0.05)
    old, new = replaced
    cli = ScriptedCLI({"add server": "New server registered.", "del server": ATTACHED})
    current = SimpleNamespace(model=old, worker_pid=42)
    published: list[dict] = []
    applier = RuntimeApplier(cli, remove_wait_s=0.3, current_pid=lambda: current.worker_pid,
                             publish_removals=lambda removals: published.append(dict(removals)))
    removals = applier.pending.removals
    assert (await applier(current, new)).applied is True  # live, no reload
    assert list(removals) == ["app1/app1_r1"] and removals["app1/app1_r1"].last_answer == ATTACHED
    # Taken out before the pending state: maint, then the placeholder address.
    assert cli.sent.index("set server app1/app1_r1 state maint") < cli.sent.index(
        "set server app1/app1_r1 addr 127.0.0.1 port 1")
    task = asyncio.get_running_loop().create_task(applier.pending.run())
    try:
        # The sessions are shut down once the removal has waited remove_wait_s, then deleted.
        # The flag is set once the command's answer is back: wait for it, not for the send.
        while not removals["app1/app1_r1"].sessions_shut_down:
            await asyncio.sleep(0.01)
        assert "shutdown sessions server app1/app1_r1" in cli.sent
        cli.answers["del server"] = "Server deleted."
        while removals:
            await asyncio.sleep(0.01)
        tries = cli.sent.count("del server app1/app1_r1")
        await asyncio.sleep(0.2)
        assert cli.sent.count("del server app1/app1_r1") == tries  # nothing more once deleted
        # Each change was published: held, retried (sessions shut down along the way), deleted.
        assert list(published[0]) == ["app1/app1_r1"] and published[-1] == {}
        assert any(p and p["app1/app1_r1"].sessions_shut_down for p in published)
    finally:
        task.cancel()


async def test_a_pending_removal_ends_when_its_worker_is_no_longer_current(replaced):
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    old, new = replaced
    cli = ScriptedCLI({"add server": "New server registered.", "del server": ATTACHED})
    current = SimpleNamespace(model=old, worker_pid=42)
    applier = RuntimeApplier(cli, current_pid=lambda: current.worker_pid)
    removals = applier.pending.removals
    assert (await applier(current, new)).applied is True
    assert removals
    task = asyncio.get_running_loop().create_task(applier.pending.run())
    try:
        current.worker_pid = 43  # a reload: the new worker never had the server
        applier.pending._wake.set()
        for _ in range(100):
            if not removals:
                break
            await asyncio.sleep(0.01)
        assert not removals
    finally:
        task.cancel()


async def test_a_server_added_back_while_its_removal_is_pending_reloads_if_still_refused(replaced):
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    old, new = replaced
    cli = ScriptedCLI({"add server": "New server registered.", "del server": ATTACHED})
    current = SimpleNamespace(model=old, worker_pid=42)
    applier = RuntimeApplier(cli, current_pid=lambda: current.worker_pid)
    assert (await applier(current, new)).applied is True
    current.model = new
    assert (await applier(current, old)).applied is False  # app1_r1 is back
    cli.answers["del server"] = "Server deleted."
    # Deleted first, then added.
    assert (await applier(current, old)).applied is True


async def test_an_add_refused_deletes_what_was_added_and_keeps_the_model(replaced):
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    old, _ = replaced
    new = Config.parse(edit(RAY, "    server app1_r1 127.0.0.1:9001 check\n",
                            "    server app1_r3 127.0.0.1:9003 check\n    server app1_r4 127.0.0.1:9004 check\n"))
    cli = ScriptedCLI({
        "add server app1/app1_r4": "'cookie' option is not accepted for dynamic server",
        "add server": "New server registered.",
        "del server": "Server deleted.",
    })
    current = SimpleNamespace(model=old, worker_pid=42)
    outcome = await RuntimeApplier(cli)(current, new)
    assert outcome.applied is False
    assert current.model is old and outcome.runs is None
    assert "del server app1/app1_r3" in cli.sent  # taken back
    assert not any(c.startswith(("del server app1/app1_r1", "set server app1/app1_r1")) for c in cli.sent)


async def test_add_server_is_sent_again_in_experimental_mode_when_haproxy_asks_for_it(replaced):
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    old, new = replaced
    cli = ScriptedCLI(
        {"add server": "New server registered.", "del server": "Server deleted."},
        experimental="This command is restricted to experimental mode only.",
    )
    current = SimpleNamespace(model=old, worker_pid=42)
    assert (await RuntimeApplier(cli)(current, new)).applied is True
    add = "add server app1/app1_r3 127.0.0.1:9003 inter 500ms weight 7 check"
    assert cli.sent[:3] == [add, "experimental-mode on", add]
    assert "del server app1/app1_r1" in cli.sent


# ---------------------------------------------------------------- a change completed by what the worker holds


def held_states(*servers: tuple[str, str, int]) -> list:
    from supervisor.haproxy.answers import ServerState

    return [ServerState(key.split("/")[0], key.split("/")[1], addr, port, 2, 1, 1) for key, addr, port in servers]


@pytest.mark.parametrize(
    ("held", "adds", "present", "removes"),
    [
        # Nothing made yet: the plan as it was.
        ([("app1/app1_r1", "127.0.0.1", 9001), ("app1/app1_r2", "127.0.0.1", 9002), ("app1/fallback", "127.0.0.1",
                                                                                     9100)],
         ["app1/app1_r3"], [], ["app1/app1_r1"]),
        # Killed after the add: app1_r3 is only readied.
        ([("app1/app1_r1", "127.0.0.1", 9001), ("app1/app1_r2", "127.0.0.1", 9002), ("app1/app1_r3", "127.0.0.1",
                                                                                     9003),
          ("app1/fallback", "127.0.0.1", 9100)],
         [], ["app1/app1_r3"], ["app1/app1_r1"]),
        # Killed after the delete: nothing left to remove.
        ([("app1/app1_r2", "127.0.0.1", 9002), ("app1/app1_r3", "127.0.0.1", 9003),
          ("app1/fallback", "127.0.0.1", 9100)],
         [], ["app1/app1_r3"], []),
        # A removal an earlier daemon left pending (neither config has app1_r0): removed too.
        ([("app1/app1_r0", "127.0.0.1", 1), ("app1/app1_r1", "127.0.0.1", 9001), ("app1/app1_r2", "127.0.0.1", 9002),
          ("app1/fallback", "127.0.0.1", 9100)],
         ["app1/app1_r3"], [], ["app1/app1_r1", "app1/app1_r0"]),
    ],
)
def test_a_change_is_completed_by_what_the_worker_holds(replaced, held, adds, present, removes):
    from supervisor.haproxy.runtime.plan import completed_plan

    old, new = replaced
    done = completed_plan(runtime_plan(old, new), held_states(*held), new)
    assert not isinstance(done, str)
    assert ([a.key for a in done.adds], [a.key for a in done.present], list(done.removes)) == (
        adds, present, removes)


def test_an_add_the_worker_holds_at_another_address_reloads(replaced):
    from supervisor.haproxy.runtime.plan import completed_plan

    old, new = replaced
    held = held_states(("app1/app1_r1", "127.0.0.1", 9001), ("app1/app1_r3", "127.0.0.1", 9999))
    assert completed_plan(runtime_plan(old, new), held, new) == (
        "app1/app1_r3: the worker holds it at 127.0.0.1:9999, not 127.0.0.1:9003")


class HoldingCLI(ScriptedCLI):
    """A worker that holds app1_r3 already (added by a daemon killed in the middle of the change)."""

    STATES = (
        "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
        "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
        "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl "
        "srv_check_port srv_check_addr srv_agent_addr srv_agent_port\n"
        "3 app1 1 app1_r1 127.0.0.1 2 0 7 7 0 6 3 4 6 0 0 0 - 9001 - 0 0 - - 0\n"
        "3 app1 2 app1_r2 127.0.0.1 2 0 7 7 0 6 3 4 6 0 0 0 - 9002 - 0 0 - - 0\n"
        "3 app1 3 fallback 127.0.0.1 2 0 1 1 0 1 0 0 0 0 0 0 - 9100 - 0 0 - - 0\n"
        "3 app1 4 app1_r3 127.0.0.1 0 1 7 7 0 6 3 4 6 0 0 0 - 9003 - 0 0 - - 0\n\n"
    )

    async def execute(self, line: str, timeout: float | None = None) -> str:
        if line.endswith("show servers state app1"):
            self.sent.append("show servers state app1")
            return self.STATES
        return await super().execute(line, timeout)


async def test_a_change_a_killed_daemon_began_is_completed_at_runtime(replaced):
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    old, new = replaced
    cli = HoldingCLI({
        "add server": "Already exists a server with the same name in backend.",
        "del server": "Server deleted.",
    })
    current = SimpleNamespace(model=old, worker_pid=42)
    assert (await RuntimeApplier(cli)(current, new)).applied is True
    assert "show servers state app1" in cli.sent
    assert cli.sent.count("add server app1/app1_r3 127.0.0.1:9003 inter 500ms weight 7 check") == 1  # not twice
    assert "set server app1/app1_r3 state ready" in cli.sent and "del server app1/app1_r1" in cli.sent


async def test_control_a_worker_this_daemon_changed_is_not_read_again(replaced):
    # Once this daemon has changed the worker, an `Already exists` is a real refusal: a reload.
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    old, new = replaced
    cli = HoldingCLI({"add server": "Already exists a server with the same name in backend."})
    applier = RuntimeApplier(cli)
    current = SimpleNamespace(model=old, worker_pid=42)
    applier._known_workers.add(42)
    assert (await applier(current, new)).applied is False
    assert "show servers state app1" not in cli.sent


def test_a_pending_removal_is_retried_ever_less_often_up_to_a_bound():
    from supervisor.haproxy.runtime.hook import RETRY_FIRST_S, RETRY_MAX_S, retry_delay

    delays = [retry_delay(tries) for tries in range(1, 10)]
    assert delays[0] == RETRY_FIRST_S and delays[1] == 2 * RETRY_FIRST_S
    assert delays == sorted(delays) and max(delays) == RETRY_MAX_S <= 3


class LeftoverCLI(HoldingCLI):
    """A worker holding app1_r3 in maint at the placeholder: a removal an earlier daemon left
    pending. `add server app1/app1_r3` is refused until it is deleted."""

    STATES = HoldingCLI.STATES.replace("3 app1 4 app1_r3 127.0.0.1 0 1 7 7 0 6 3 4 6 0 0 0 - 9003",
                                       "3 app1 4 app1_r3 127.0.0.1 0 1 7 7 0 6 3 4 6 0 0 0 - 1")

    async def execute(self, line: str, timeout: float | None = None) -> str:
        if "del server app1/app1_r3" in self.sent:
            self.answers["add server"] = "New server registered."
        return await super().execute(line, timeout)


async def test_a_name_added_back_over_a_removal_left_at_the_placeholder_is_deleted_then_added(replaced):
    from supervisor.haproxy.runtime.hook import RuntimeApplier

    old, new = replaced
    cli = LeftoverCLI({
        "add server": "Already exists a server with the same name in backend.",
        "del server": "Server deleted.",
    })
    current = SimpleNamespace(model=old, worker_pid=42)
    assert (await RuntimeApplier(cli)(current, new)).applied is True
    add = "add server app1/app1_r3 127.0.0.1:9003 inter 500ms weight 7 check"
    assert cli.sent.index("del server app1/app1_r3") < len(cli.sent) - 1 - cli.sent[::-1].index(add)
    assert cli.sent.count(add) == 2  # refused, then added once the leftover was deleted
