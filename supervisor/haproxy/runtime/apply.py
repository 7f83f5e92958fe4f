"""Sending changes to one worker's live servers, checking every answer.

Make before break: the changes go out in two phases. First every change after which the
server is in service (enables, new addresses and weights of live servers), then the
disables. Within each backend the enables are complete (`state ready` accepted) before
any disable begins, so a backend never has fewer usable servers during a change than at
its start or at its end: a slot handing over to another in one write never leaves the
backend with no server (`backend 'be' has no server available!`, 503s). When a first-phase
command is refused in a backend, that backend's disables are not sent (the reload that
follows does them): nothing is broken that was not made.

Within a phase, commands are batched across servers, one step at a time: the first
command of every server's sequence on one master-CLI line (`@!<pid> cmd;@!<pid> cmd;...`),
every answer checked, then the second command of the servers whose first was accepted,
and so on. One `;` line runs all its commands whatever each answers, so the commands of
ONE server never share a line: a refusal can only stop what has not been sent yet.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..answers import split_answers
from ..api import DEFAULT_LINE_LIMIT, CLIError, MasterCLI, batch_lines, on_process
from .plan import ServerChange, ordered_commands

log = logging.getLogger(__package__)


# What `set server ... addr` answers when it took. 2.6 and 2.8: `no need to change the addr, port
# changed from 'a' to 'b' by 'stats socket command'` (either part may say changed or no need);
# 3.0 on: `IP changed from 'a' to 'b', port changed from ... by ...`, either part alone, or
# `nothing changed`.
_ADDR_ACCEPTED = re.compile(
    r"^(?:nothing changed\.?"
    r"|(?:(?:IP changed from '[^']*' to '[^']*'|no need to change the addr)"
    r"(?:, (?:port changed from '[^']*' to '[^']*'|no need to change the port))?"
    r"|port changed from '[^']*' to '[^']*')"
    r" by '[^']*'\.?)$"
)


def refusal(command: str, answer: str | None) -> str | None:
    """None when HAProxy accepted `command`, else why not (its own words when it gave any).

    `state`, `weight`, `enable health|agent`, `shutdown sessions` and the map commands print
    nothing when they succeed; `addr` prints what it changed; `add server` and `del server`
    say they did it. Anything else, including an answer this code does not know, counts as
    refused: the safe reading, since the sequence then stops with the server out of rotation.
    """
    if answer is None:
        return "no answer"
    text = answer.strip()
    words = command.split(maxsplit=3)
    if words[:1] and words[0].startswith("@"):
        words = words[1:]
    if words[:2] in (["add", "server"], ["del", "server"]):
        said = "New server registered" if words[0] == "add" else "Server deleted"
        return None if text.startswith(said) else (text or f"empty answer to {words[0]} server")
    if " addr " in command:
        return None if _ADDR_ACCEPTED.match(text) else (text or "empty answer to addr")
    return None if text == "" else text


def deleted(command: str, answer: str | None, asked_before: bool) -> bool:
    """Did `del server` take? `No such server.` to a server this apply already asked to delete
    is a deletion too: the earlier answer was lost (a timeout, a line that could not be read),
    not the deletion."""
    if refusal(command, answer) is None:
        return True
    return asked_before and answer is not None and answer.strip() == "No such server."


@dataclass(frozen=True, slots=True)
class Refusal:
    change: ServerChange
    command: str
    answer: str
    accepted: tuple[str, ...]  # the commands of this server's sequence that HAProxy accepted

    @property
    def left_in_maint(self) -> bool:
        return any(c.endswith(" state maint") for c in self.accepted)


@dataclass
class ApplyResult:
    applied: list[ServerChange] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    # Disables not sent because a first-phase command of their backend was refused.
    skipped: list[ServerChange] = field(default_factory=list)
    commands_sent: int = 0
    lines_sent: int = 0

    @property
    def ok(self) -> bool:
        return not self.refused and not self.skipped


async def send_line(cli: MasterCLI, line: str) -> list[str | None]:
    """Send one `;` line; one answer per command, read by what each command prints."""
    # Names and addresses are validated, so `;` only ever separates commands.
    commands = line.split(";")
    count = len(commands)
    try:
        text = await cli.execute(line)
    except CLIError as exc:
        return [f"no answer: {exc}"] * count
    answers = split_answers(text, commands)
    if answers is None:
        # Cannot tell which command said what: every command of the line counts as refused.
        unexpected = text.strip() or "empty answer"
        return [f"unexpected answer to {count} commands: {unexpected}"] * count
    return list(answers)


async def send_step(
    cli: MasterCLI, worker_pid: int, commands: Sequence[str], line_limit: int
) -> tuple[list[str | None], int]:
    """Send one step's commands (one per server) as few `;` lines as fit; answers in order."""
    lines = batch_lines([on_process(worker_pid, c) for c in commands], line_limit)
    tasks: list[asyncio.Task[list[str | None]]] = []
    async with asyncio.TaskGroup() as group:
        for line in lines:
            tasks.append(group.create_task(send_line(cli, line)))
    answers: list[str | None] = []
    for task in tasks:
        answers.extend(task.result())
    return answers, len(lines)


def takes_out(change: ServerChange) -> bool:
    """Does the change take a server out of service (a disable)?"""
    return change.was_enabled and not change.enabled


def make_before_break(changes: Iterable[ServerChange]) -> list[list[ServerChange]]:
    """The phases of a change (module doc): what leaves servers in service, then the disables."""
    changes = list(changes)
    making = [c for c in changes if not takes_out(c)]
    breaking = [c for c in changes if takes_out(c)]
    return [phase for phase in (making, breaking) if phase]


async def apply_changes(
    cli: MasterCLI,
    worker_pid: int,
    changes: Iterable[ServerChange],
    *,
    order: Callable[[ServerChange], list[str]] = ordered_commands,
    line_limit: int = DEFAULT_LINE_LIMIT,
    phased: bool = True,
) -> ApplyResult:
    """Apply changes to one worker, make before break, step by step across servers, checking
    every answer.

    `order` and `phased=False` (every change in one phase) exist so a test can drive the
    wrong order and show the window it opens.
    """
    worker_pid = int(worker_pid)
    result = ApplyResult()
    changes = list(changes)
    unmade: set[str] = set()  # backends where a first-phase command was refused
    for phase in make_before_break(changes) if phased else [changes]:
        skipped = [c for c in phase if c.backend in unmade]
        if skipped:
            result.skipped.extend(skipped)
            log.warning(
                "worker %d: %d disables not sent in backends %s, where an enable was refused",
                worker_pid, len(skipped), ", ".join(sorted({c.backend for c in skipped})),
            )
        refused = await _apply_steps(cli, worker_pid, [c for c in phase if c.backend not in unmade], order,
                                     line_limit, result)
        unmade.update(r.change.backend for r in refused)
    return result


async def _apply_steps(
    cli: MasterCLI,
    worker_pid: int,
    changes: list[ServerChange],
    order: Callable[[ServerChange], list[str]],
    line_limit: int,
    result: ApplyResult,
) -> list[Refusal]:
    """One phase: every server's sequence, step by step across servers; adds to `result` and
    returns this phase's refusals."""
    plans = [(change, order(change)) for change in changes]
    accepted: list[list[str]] = [[] for _ in plans]
    stopped: dict[int, Refusal] = {}
    step = 0
    while True:
        batch = [
            (i, sequence[step])
            for i, (_, sequence) in enumerate(plans)
            if step < len(sequence) and i not in stopped
        ]
        if not batch:
            break
        answers, lines = await send_step(cli, worker_pid, [command for _, command in batch], line_limit)
        result.commands_sent += len(batch)
        result.lines_sent += lines
        for (i, command), answer in zip(batch, answers, strict=True):
            reason = refusal(command, answer)
            if reason is None:
                accepted[i].append(command)
                continue
            refused = Refusal(plans[i][0], command, reason, tuple(accepted[i]))
            stopped[i] = refused
            log.warning(
                "worker %d refused %r: %s; %s",
                worker_pid,
                command,
                reason,
                "server left in maint" if refused.left_in_maint else "server left as it was",
            )
        step += 1
    for i, (change, _) in enumerate(plans):
        if i in stopped:
            result.refused.append(stopped[i])
        else:
            result.applied.append(change)
    return list(stopped.values())
