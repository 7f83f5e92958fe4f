"""Changes to one worker's live servers, every answer checked (docs/runtime-changes.md). Make
before break: what leaves a server in service goes out before any disable. A `;` line runs all
its commands whatever each answers, so one server's commands never share a line."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..answers import parse_show_map, split_answers
from ..api import CLIError, MasterCLI, batch_lines, on_process
from ..config import Config
from ..guard import is_guarded
from .plan import RuntimePlan, ServerAdd, ServerChange, loaded_slot_table, ordered_commands, slot_map_commands

log = logging.getLogger(__package__)

# What `set server ... addr` answers when it took: 2.6 and 2.8 `no need to change the addr, port
# changed from 'a' to 'b' by '...'` (either part changed or not); 3.0 on `IP changed from 'a' to
# 'b', port changed from ... by ...`, either part alone, or `nothing changed`.
_ADDR_ACCEPTED = re.compile(
    r"^(?:nothing changed\.?"
    r"|(?:(?:IP changed from '[^']*' to '[^']*'|no need to change the addr)"
    r"(?:, (?:port changed from '[^']*' to '[^']*'|no need to change the port))?"
    r"|port changed from '[^']*' to '[^']*')"
    r" by '[^']*'\.?)$"
)


def refusal(command: str, answer: str | None) -> str | None:
    """None when HAProxy accepted `command`, else why not. An unknown answer counts as refused:
    the sequence then stops out of rotation."""
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
    """Did `del server` take? `No such server.` to one asked before did: the answer was lost."""
    if refusal(command, answer) is None:
        return True
    return asked_before and answer is not None and answer.strip() == "No such server."


@dataclass(frozen=True, slots=True)
class Refusal:
    change: ServerChange
    command: str
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
    """Send one `;` line; one answer per command."""
    # Names and addresses are validated, so `;` only ever separates commands.
    commands = line.split(";")
    count = len(commands)
    try:
        text = await cli.execute(line)
    except CLIError as exc:
        return [f"no answer: {exc}"] * count
    answers = split_answers(text, commands)
    if answers is None:
        # Who said what is unknown: every command of the line counts as refused.
        unexpected = text.strip() or "empty answer"
        return [f"unexpected answer to {count} commands: {unexpected}"] * count
    return list(answers)


async def send_step(cli: MasterCLI, worker_pid: int, commands: Sequence[str]) -> tuple[list[str | None], int]:
    """Send one step's commands (one per server) as few `;` lines as fit; answers in order."""
    lines = batch_lines([on_process(worker_pid, c) for c in commands])
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(send_line(cli, line)) for line in lines]
    return [answer for task in tasks for answer in task.result()], len(lines)


async def apply_changes(cli: MasterCLI, worker_pid: int, changes: Iterable[ServerChange]) -> ApplyResult:
    worker_pid = int(worker_pid)
    result = ApplyResult()
    changes = list(changes)
    unmade: set[str] = set()  # backends where a first-phase command was refused
    making = [c for c in changes if not c.takes_out]
    for phase in [making, [c for c in changes if c.takes_out]]:
        skipped = [c for c in phase if c.backend in unmade]
        if skipped:
            result.skipped.extend(skipped)
            log.warning(
                "worker %d: %d disables not sent in backends %s, where an enable was refused",
                worker_pid, len(skipped), ", ".join(sorted({c.backend for c in skipped})),
            )
        refused = await _apply_steps(cli, worker_pid, [c for c in phase if c.backend not in unmade], result)
        unmade.update(r.change.backend for r in refused)
    return result


async def _apply_steps(
    cli: MasterCLI, worker_pid: int, changes: list[ServerChange], result: ApplyResult
) -> list[Refusal]:
    """One phase, step by step across servers; adds to `result`, returns its refusals."""
    plans = [(change, ordered_commands(change)) for change in changes]
    accepted: list[list[str]] = [[] for _ in plans]
    stopped: dict[int, Refusal] = {}
    step = 0
    while True:
        batch = [(i, seq[step]) for i, (_, seq) in enumerate(plans) if step < len(seq) and i not in stopped]
        if not batch:
            break
        answers, lines = await send_step(cli, worker_pid, [command for _, command in batch])
        result.commands_sent += len(batch)
        result.lines_sent += lines
        for (i, command), answer in zip(batch, answers, strict=True):
            reason = refusal(command, answer)
            if reason is None:
                accepted[i].append(command)
                continue
            refused = Refusal(plans[i][0], command, tuple(accepted[i]))
            stopped[i] = refused
            log.warning("worker %d refused %r: %s; %s", worker_pid, command, reason,
                        "server left in maint" if refused.left_in_maint else "server left as it was")
        step += 1
    for i, (change, _) in enumerate(plans):
        if i in stopped:
            result.refused.append(stopped[i])
        else:
            result.applied.append(change)
    return list(stopped.values())


REMOVE_POLL_S = 0.1
PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT = "127.0.0.1", 1
# How long `del server` is still tried after `shutdown sessions server`: sessions close asynchronously.
AFTER_SHUTDOWN_S = 2.0


def _needs_experimental_mode(answer: str | None) -> bool:
    return answer is not None and "experimental" in answer.lower()


async def send_commands(
    cli: MasterCLI, pid: int, commands: Sequence[str], prefix: Sequence[str] = ()
) -> list[str | None]:
    """One answer per command to worker `pid`; a session mode (`prefix`) rides on each command's line."""
    if not prefix:
        return (await send_step(cli, pid, commands))[0]
    return [(await send_line(cli, ";".join([*prefix, on_process(pid, c)])))[-1] for c in commands]


@dataclass
class MembershipResult:
    """What apply_membership() did; `why`: the reason for the reload when not ok. `made`: the
    added servers are in service. `pending`: removals in maint at the placeholder whose `del
    server` is still refused (key -> answer); `mode`: what this worker's lines begin with."""

    ok: bool = True
    why: str = ""
    made: bool = False
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)
    mode: list[str] = field(default_factory=list)
    # An add answered "Already exists", or a removal's `state maint` "No such server.": the worker
    # holds part of this change already (hook.py completes it).
    held_already: bool = False
    commands_sent: int = 0


class _Sender:
    """One membership change in one worker: where its commands go, and how its removes wait."""

    def __init__(
        self, cli: MasterCLI, worker_pid: int, result: MembershipResult, remove_wait_s: float, background: bool
    ) -> None:
        self.cli, self.pid, self.result = cli, worker_pid, result
        self.remove_wait_s, self.background = remove_wait_s, background

    async def send(self, commands: Sequence[str]) -> list[str | None]:
        self.result.commands_sent += len(commands)
        return await send_commands(self.cli, self.pid, commands, self.result.mode)


async def apply_membership(
    cli: MasterCLI, worker_pid: int, plan: RuntimePlan, new: Config, *, remove_wait_s: float, background: bool
) -> MembershipResult:
    """Add and remove servers, make before break: adds, changes, slot table, removes (docs/removals.md)."""
    result = MembershipResult()
    sender = _Sender(cli, int(worker_pid), result, remove_wait_s, background)
    table = await _slot_table_commands(cli, sender.pid, new, plan.backends)
    if isinstance(table, str):
        return _failed(result, table)
    why = await _add(sender, plan.adds, plan.present)
    if why:
        await _take_back(sender)
        return _failed(result, why)
    if plan.changes:
        applied = await apply_changes(cli, sender.pid, plan.changes)
        result.commands_sent += applied.commands_sent
        if not applied.ok:
            await _take_back(sender)
            return _failed(result, f"{len(applied.refused)} in-place server changes refused")
    result.made = True
    table_answers = await sender.send(table)
    for command, answer in zip(table, table_answers, strict=True):
        if (reason := refusal(command, answer)) is not None:
            return _failed(result, f"slot table: {command!r} refused: {reason}")
    why = await _remove(sender, list(plan.removes), result)
    if why:
        return _failed(result, why)
    return result


def _failed(result: MembershipResult, why: str) -> MembershipResult:
    result.ok, result.why = False, why
    return result


async def _slot_table_commands(cli: MasterCLI, pid: int, new: Config, backends: set[str]) -> list[str] | str:
    """The map commands that make the worker's slot table `new`'s (read once it is old), or why not."""
    if not any(is_guarded(s) for s in new.backends() if s.name in backends):
        return []
    try:
        path = loaded_slot_table(await cli.on(pid, "show map"))
        if path is None:
            return f"worker {pid} lists no slot table in `show map`"
        held = dict(parse_show_map(await cli.on(pid, f"show map {path}")))
    except (CLIError, ValueError) as exc:
        return f"cannot read worker {pid}'s slot table: {exc}"
    return slot_map_commands(path, held, new, backends)


async def _add(sender: _Sender, adds: Sequence[ServerAdd], present: Sequence[ServerAdd]) -> str:
    """Add in maint, then step by step checks and `state ready` (`present` too); a refusal, or ''."""
    result = sender.result
    result.added.extend(add.key for add in present)
    answers = await sender.send([a.add_command for a in adds])
    if any(_needs_experimental_mode(a) for a in answers):
        result.mode = ["experimental-mode on"]
        log.info("worker %d: `add server` needs experimental-mode on this HAProxy: enabled", sender.pid)
        retry = [i for i, a in enumerate(answers) if _needs_experimental_mode(a)]
        for i, answer in zip(retry, await sender.send([adds[i].add_command for i in retry]), strict=True):
            answers[i] = answer
    why = ""
    for add, answer in zip(adds, answers, strict=True):
        reason = refusal(add.add_command, answer)
        if reason is None:
            result.added.append(add.key)
            continue
        if reason.startswith("Already exists a server with the same name"):
            result.held_already = True
        why = why or f"`{add.add_command}` refused: {reason}"
    if why:
        return why
    for step in itertools.zip_longest(*(add.ready_commands for add in (*adds, *present))):
        batch = [command for command in step if command is not None]
        for command, answer in zip(batch, await sender.send(batch), strict=True):
            if (reason := refusal(command, answer)) is not None:
                return f"`{command}` refused: {reason}"
    return ""


async def _take_back(sender: _Sender) -> None:
    """Undo the adds after a refusal, best effort: what is still refused is pending."""
    if sender.result.added:
        undone = MembershipResult()
        leftover = await _remove(sender, list(sender.result.added), undone)
        sender.result.pending.update(undone.pending)
        if leftover:
            log.warning("worker %d: servers added before a refusal not all deleted: %s", sender.pid, leftover)


async def _remove(sender: _Sender, keys: list[str], result: MembershipResult) -> str:
    """Servers to maint, then `del server`, refused while connections are attached: the refused
    get the placeholder address and one more try; then they are pending (in the background), or
    tried for remove_wait_s, their sessions shut down, and a little longer. What is left, or ''."""
    if not keys:
        return ""
    maint = [f"set server {key} state maint" for key in keys]
    answers = await sender.send(maint)
    refused = [(c, reason) for c, a in zip(maint, answers, strict=True) if (reason := refusal(c, a)) is not None]
    if any(reason == "No such server." for _, reason in refused):
        result.held_already = True
    if refused:
        command, reason = refused[0]
        return f"`{command}` refused: {reason}"
    left = list(keys)
    loop = asyncio.get_running_loop()
    wait_s = sender.remove_wait_s
    deadline = loop.time() + wait_s
    shut = purged = False
    asked: set[str] = set()
    last_answer: dict[str, str] = {}
    while True:
        commands = [f"del server {key}" for key in left]
        answers = await sender.send(commands)
        for key, command, answer in zip(list(left), commands, answers, strict=True):
            if deleted(command, answer, key in asked):
                left.remove(key)
                result.removed.append(key)
            else:
                last_answer[key] = (answer or "no answer").strip()
        asked.update(left)
        if not left:
            return ""
        if not purged:
            # HAProxy counts the server's idle connections as attached and purges them only
            # slowly; a new address (it is in maint: nothing routes to it) closes them at once.
            placeholder = [f"set server {key} addr {PLACEHOLDER_ADDRESS} port {PLACEHOLDER_PORT}" for key in left]
            for command, answer in zip(placeholder, await sender.send(placeholder), strict=True):
                if refusal(command, answer) is not None:  # still in maint: it routes nothing all the same
                    log.warning("worker %d refused %r: %s", sender.pid, command, (answer or "no answer").strip())
            purged = True
            continue
        if sender.background:
            # In maint at the placeholder: it routes nothing, the change is live.
            result.pending.update({key: last_answer[key] for key in left})
            return ""
        if loop.time() >= deadline:
            if shut:
                last = f"`del server {left[-1]}`: {last_answer[left[-1]]}"
                return f"{len(left)} servers not deleted after {wait_s:g}s and their sessions shut down; last {last}"
            log.info("worker %d: sessions still on %d removed servers after %gs: shutting them down",
                     sender.pid, len(left), wait_s)
            await sender.send([f"shutdown sessions server {key}" for key in left])
            shut = True
            deadline = loop.time() + AFTER_SHUTDOWN_S
        await asyncio.sleep(REMOVE_POLL_S)
