"""Runtime changes: make before break (pure, a CLI that answers as HAProxy does): a backend never
has fewer servers during a change than at its ends."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from supervisor.haproxy.api import batch_lines
from supervisor.haproxy.runtime import apply
from supervisor.haproxy.runtime.apply import apply_changes, refusal, send_step
from supervisor.haproxy.runtime.plan import ServerChange, ordered_commands
from tests.test_runtime_commands import change

# ---------------------------------------------------------------- make before break


class AnsweringCLI:
    """Answers every command as HAProxy does when it accepts it; records what was sent, in order.
    `refuse` names commands answered with a refusal instead."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.commands: list[str] = []
        self.refuse = refuse

    async def execute(self, line: str) -> str:
        answers = []
        for command in line.split(";"):
            command = command.split(" ", 1)[1]  # drop the @!<pid> prefix
            self.commands.append(command)
            if command in self.refuse:
                answers.append("No such server.\n\n")
            elif " addr " in command:
                answers.append("no need to change the addr, port changed from '1' to '2' by 'stats socket command'\n\n")
            else:
                answers.append("\n")
        return "".join(answers)


def usable_counts(changes: list[ServerChange], commands: list[str]) -> dict[str, list[int]]:
    """Per backend, how many servers are in service before the first command and after each."""
    enabled = {c.key: c.was_enabled for c in changes}
    counts = {b: [sum(v for k, v in enabled.items() if k.startswith(f"{b}/"))] for b in {c.backend for c in changes}}
    for command in commands:
        key = command.split()[2]
        if command.endswith("state maint"):
            enabled[key] = False
        elif command.endswith("state ready"):
            enabled[key] = True
        backend = key.split("/")[0]
        counts[backend].append(sum(v for k, v in enabled.items() if k.startswith(f"{backend}/")))
    return counts


def random_changes(rng) -> list[ServerChange]:
    changes = []
    for b in range(rng.randrange(1, 3)):
        for s in range(rng.randrange(1, 5)):
            was, now = rng.random() < 0.5, rng.random() < 0.5
            readdress, reweight = rng.random() < 0.6, rng.random() < 0.3
            if not (was != now or readdress or reweight):
                readdress = True
            changes.append(change(
                backend=f"b{b}", server=f"s{s}", was_enabled=was, enabled=now,
                to_port=9000 + s if readdress else 8080, to_weight=7 if reweight else 1,
            ))
    return changes


async def step_synchronous(cli, worker_pid: int, changes: list[ServerChange]) -> list[str]:
    """Every server's sequence in one phase, step by step across servers: the order make before
    break replaces, to show its window. The refusals."""
    refused = []
    for step in itertools.zip_longest(*map(ordered_commands, changes)):
        batch = [command for command in step if command is not None]
        answers, _ = await send_step(cli, worker_pid, batch)
        refused += [r for c, a in zip(batch, answers, strict=True) if (r := refusal(c, a)) is not None]
    return refused


async def test_a_backend_never_has_fewer_servers_during_a_change_than_at_its_ends(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(apply, "batch_lines", functools.partial(batch_lines, limit=200))  # several lines a step
    rng = random.Random(15)
    for _ in range(500):
        changes = random_changes(rng)
        cli = AnsweringCLI()
        result = await apply_changes(cli, 1, changes)
        assert result.ok and sorted(c.key for c in result.applied) == sorted(c.key for c in changes)
        for backend, counts in usable_counts(changes, cli.commands).items():
            assert min(counts) >= min(counts[0], counts[-1]), (backend, changes, cli.commands)


async def test_control_step_synchronous_order_empties_the_backend_on_a_hand_over():
    hand_over = [
        change(server="SRV_1", to_port=1, enabled=False),
        change(server="SRV_2", from_port=1, to_port=8081, was_enabled=False),
    ]
    cli = AnsweringCLI()
    assert await step_synchronous(cli, 1, hand_over) == []
    assert min(usable_counts(hand_over, cli.commands)["app"]) == 0
    cli = AnsweringCLI()
    assert (await apply_changes(cli, 1, hand_over)).ok
    assert cli.commands == [
        "set server app/SRV_2 state maint",
        "set server app/SRV_2 addr 127.0.0.1 port 8081",
        "set server app/SRV_2 state ready",
        "set server app/SRV_1 state maint",
        "set server app/SRV_1 addr 127.0.0.1 port 1",
    ]


async def test_a_refused_enable_keeps_its_backends_disables_back():
    changes = [
        change(backend="a", server="in", from_port=1, to_port=8081, was_enabled=False),
        change(backend="a", server="out", to_port=1, enabled=False),
        change(backend="b", server="out", to_port=1, enabled=False),
    ]
    cli = AnsweringCLI(refuse=frozenset({"set server a/in addr 127.0.0.1 port 8081"}))
    result = await apply_changes(cli, 1, changes)
    assert [r.change.key for r in result.refused] == ["a/in"] and result.refused[0].left_in_maint
    assert [c.key for c in result.skipped] == ["a/out"] and not result.ok
    assert [c.key for c in result.applied] == ["b/out"]
    assert not any(c.startswith("set server a/out") for c in cli.commands)
