"""Servers added (`add server`) and removed (`del server`) in the current worker, by name, with
its slot table kept in step; the changes to servers that stay are applied in between."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..answers import parse_show_map
from ..api import DEFAULT_LINE_LIMIT, CLIError, MasterCLI, on_process
from ..config import Config
from ..guard import is_guarded
from ..membership import ServerAdd, loaded_slot_table, slot_map_commands
from .apply import apply_changes, deleted, refusal, send_line, send_step
from .plan import RuntimePlan

log = logging.getLogger(__package__)


REMOVE_POLL_S = 0.1
PLACEHOLDER_ADDRESS, PLACEHOLDER_PORT = "127.0.0.1", 1
# After `shutdown sessions server`, how long `del server` is still tried: the sessions close
# asynchronously, within a few milliseconds of the command.
AFTER_SHUTDOWN_S = 2.0


def _needs_experimental_mode(answer: str | None) -> bool:
    return answer is not None and "experimental" in answer.lower()


@dataclass
class MembershipResult:
    """What apply_membership() did. Not ok: `why` (one line) is the reason for the reload
    that follows. `made`: added servers are in service in the worker (the removes failed),
    so it runs the new config's servers, plus removed ones left in maint. `pending`: removed
    servers in maint at the placeholder whose `del server` is still refused (key -> the
    answer), for the background (pending.py); `mode`: what each of this worker's lines
    began with (`experimental-mode on`, when it asked for it)."""

    ok: bool = True
    why: str = ""
    made: bool = False
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)
    mode: list[str] = field(default_factory=list)
    # An add answered "Already exists", or a removal's `state maint` "No such server.": the
    # worker holds part of this change already (hook.py then completes it by what it holds).
    held_already: bool = False
    commands_sent: int = 0


class _Sender:
    """One worker's commands, as few `;` lines as fit, every answer returned in order."""

    def __init__(self, cli: MasterCLI, worker_pid: int, line_limit: int, result: MembershipResult) -> None:
        self.cli, self.pid, self.line_limit, self.result = cli, worker_pid, line_limit, result
        self.prefix: list[str] = []  # `experimental-mode on`, once a worker asked for it

    async def send(self, commands: Sequence[str]) -> list[str | None]:
        if not commands:
            return []
        self.result.commands_sent += len(commands)
        if not self.prefix:
            answers, _ = await send_step(self.cli, self.pid, commands, self.line_limit)
            return answers
        answers: list[str | None] = []
        for command in commands:  # the master session's mode rides with the command on one line
            line = ";".join([*self.prefix, on_process(self.pid, command)])
            answers.append((await send_line(self.cli, line))[-1])
        return answers


async def apply_membership(
    cli: MasterCLI,
    worker_pid: int,
    plan: RuntimePlan,
    new: Config,
    *,
    remove_wait_s: float,
    line_limit: int = DEFAULT_LINE_LIMIT,
    background: bool = True,
) -> MembershipResult:
    """Add and remove servers in one worker, make before break (module doc of membership.py):
    add in maint, enable checks, ready; the in-place changes; the worker's slot table; only
    then the removed servers to maint and `del server`. A removal refused while connections
    are attached gets the placeholder address and one more `del server`; then, `background`,
    it is left pending (`result.pending`), else its sessions are waited for (`remove_wait_s`,
    then `shutdown sessions server`) and a removal still refused is a failure."""
    pid = int(worker_pid)
    result = MembershipResult()
    sender = _Sender(cli, pid, line_limit, result)
    try:
        return await _membership(sender, plan, new, remove_wait_s, background)
    finally:
        result.mode = list(sender.prefix)


async def _membership(
    sender: _Sender, plan: RuntimePlan, new: Config, remove_wait_s: float, background: bool
) -> MembershipResult:
    cli, pid, line_limit, result = sender.cli, sender.pid, sender.line_limit, sender.result
    backends = plan.backends
    table = await _slot_table_commands(cli, pid, new, backends)
    if isinstance(table, str):
        return _failed(result, table)
    why = await _add(sender, plan.adds, result, plan.present)
    if why:
        await _take_back(sender, result.added, remove_wait_s, background)
        return _failed(result, why)
    if plan.changes:
        applied = await apply_changes(cli, pid, plan.changes, line_limit=line_limit)
        result.commands_sent += applied.commands_sent
        if not applied.ok:
            await _take_back(sender, result.added, remove_wait_s, background)
            return _failed(result, f"{len(applied.refused)} in-place server changes refused")
    result.made = True
    table_answers = await sender.send(table)
    for command, answer in zip(table, table_answers, strict=True):
        if answer is None or answer.strip():
            return _failed(result, f"slot table: {command!r} refused: {(answer or 'no answer').strip()}")
    why = await _remove(sender, [r.key for r in plan.removes], remove_wait_s, result, background)
    if why:
        return _failed(result, why)
    return result


def _failed(result: MembershipResult, why: str) -> MembershipResult:
    result.ok, result.why = False, why
    return result


async def _slot_table_commands(cli: MasterCLI, pid: int, new: Config, backends: set[str]) -> list[str] | str:
    """The map commands that keep the worker's slot table what `new` says (the guard reads it
    once the worker is old), or why they cannot be known."""
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


async def _add(
    sender: _Sender, adds: Sequence[ServerAdd], result: MembershipResult, present: Sequence[ServerAdd] = ()
) -> str:
    """Add every server in maint, then step by step its checks and `state ready` (also for the
    `present` ones, which the worker holds already); the first refusal, or ''."""
    result.added.extend(add.key for add in present)
    answers = await sender.send([a.add_command for a in adds])
    if any(_needs_experimental_mode(a) for a in answers):
        sender.prefix = ["experimental-mode on"]
        log.info("worker %d: `add server` needs experimental-mode on this HAProxy: enabled", sender.pid)
        retry = [i for i, a in enumerate(answers) if _needs_experimental_mode(a)]
        for i, answer in zip(retry, await sender.send([adds[i].add_command for i in retry]), strict=True):
            answers[i] = answer
    why = ""
    for add, answer in zip(adds, answers, strict=True):
        if refusal(add.add_command, answer) is None:
            result.added.append(add.key)
            continue
        if answer is not None and answer.strip().startswith("Already exists a server with the same name"):
            result.held_already = True
        if not why:
            why = f"`{add.add_command}` refused: {(answer or 'no answer').strip() or 'empty answer'}"
    if why:
        return why
    sequences = [add.ready_commands for add in (*adds, *present)]
    step = 0
    while True:
        batch = [seq[step] for seq in sequences if step < len(seq)]
        if not batch:
            return ""
        for command, answer in zip(batch, await sender.send(batch), strict=True):
            reason = refusal(command, answer)
            if reason is not None:
                return f"`{command}` refused: {reason}"
        step += 1


async def _take_back(sender: _Sender, keys: list[str], wait_s: float, background: bool) -> None:
    """Undo adds after a refusal: the servers out of service and deleted (best effort; what is
    still refused is pending, like any removal)."""
    if keys:
        undone = MembershipResult()
        leftover = await _remove(sender, list(keys), wait_s, undone, background)
        sender.result.pending.update(undone.pending)
        if leftover:
            log.warning("worker %d: servers added before a refusal not all deleted: %s", sender.pid, leftover)


async def _remove(sender: _Sender, keys: list[str], wait_s: float, result: MembershipResult, background: bool) -> str:
    """Servers to maint, then `del server`: while connections are attached HAProxy refuses it.
    The refused get the placeholder address and one more try; then, `background`, they are
    pending (`result.pending`); else it is tried until `wait_s`, their sessions shut down and
    it is tried a little longer. What is still refused then, or ''."""
    if not keys:
        return ""
    answers = await sender.send([f"set server {key} state maint" for key in keys])
    refused = [(k, a) for k, a in zip(keys, answers, strict=True) if refusal("state", a) is not None]
    if any(a is not None and a.strip() == "No such server." for _, a in refused):
        result.held_already = True
    if refused:
        key, answer = refused[0]
        return f"`set server {key} state maint` refused: {(answer or 'no answer').strip()}"
    left = list(keys)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    shut = purged = False
    last = ""
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
                last = f"`{command}`: {last_answer[key]}"
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
        if background:
            # In maint at the placeholder: it routes nothing, the change is live.
            result.pending.update({key: last_answer[key] for key in left})
            return ""
        if loop.time() >= deadline:
            if shut:
                return f"{len(left)} servers not deleted after {wait_s:g}s and their sessions shut down; last {last}"
            log.info("worker %d: sessions still on %d removed servers after %gs: shutting them down",
                     sender.pid, len(left), wait_s)
            await sender.send([f"shutdown sessions server {key}" for key in left])
            shut = True
            deadline = loop.time() + AFTER_SHUTDOWN_S
        await asyncio.sleep(REMOVE_POLL_S)
