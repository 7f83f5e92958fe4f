"""The answers of a `;` line: the master CLI relays each command's answer after the last,
with nothing between them but what each command prints. Cut by what each command prints,
into one answer per command (each then read by its parser, answers.py)."""

from __future__ import annotations

from collections.abc import Sequence

# ---------------------------------------------------------------- answers of a `;` line

# What a command prints, as the master CLI relays it (tests/captured/answers_*.txt, from each
# supported binary):
# - SILENT: nothing when it took, else one line; then an empty line, on every version
#   (`set server ... state|weight`, `enable health|agent`, `shutdown sessions server`,
#   `add|set|del map`).
# - ONE_LINE: always one line, then an empty line or not: 2.6 ends no `del server` answer and
#   no `add server` refusal with one, 2.8 and later end every answer with one (`add server`,
#   `del server`, `set server ... addr`).
# - LISTING: lines up to an empty one (`show ...`).
# - MASTER_MODE: the master's own mode commands print nothing at all (`experimental-mode on`).
SILENT, ONE_LINE, LISTING, MASTER_MODE = "silent", "one line", "listing", "master mode"
_MASTER_MODES = ("experimental-mode", "expert-mode", "mcli-debug-mode")


def answer_shape(command: str) -> str:
    """What `command` (as it goes on the line, `@!<pid>` prefix or not) prints (see above)."""
    words = command.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    elif words and words[0] in _MASTER_MODES:
        return MASTER_MODE
    if words[:1] == ["show"]:
        return LISTING
    if words[:2] in (["add", "server"], ["del", "server"]):
        return ONE_LINE
    if words[:2] == ["set", "server"] and words[3:4] == ["addr"]:
        return ONE_LINE
    return SILENT


def _readings(shape: str, lines: list[str], at: int) -> list[tuple[int, str]]:
    """Where one command's answer may end, from line `at`, and its text: (next line, text)."""
    end = len(lines)
    if shape == MASTER_MODE:
        return [(at, "")]
    if at >= end:
        return []
    if shape == LISTING:
        stop = next((i for i in range(at, end) if lines[i] == ""), end)
        return [(min(stop + 1, end), "\n".join(lines[at:stop]))]
    if shape == SILENT:
        if lines[at] == "":
            return [(at + 1, "")]
        if at + 1 < end and lines[at + 1] == "":
            return [(at + 2, lines[at])]
        return [(at + 1, lines[at])] if at + 1 == end else []  # the last line, cut short
    if lines[at] == "":
        return []
    readings = [(at + 1, lines[at])]
    if at + 1 < end and lines[at + 1] == "":
        readings.append((at + 2, lines[at]))
    return readings


def split_answers(text: str, commands: Sequence[str]) -> list[str] | None:
    """One answer per command of a `;` line, read by what each command prints; None when
    the text cannot be read as their answers, or can be read two ways.

    A master-level error (`Can't find the target PID`) ends the line early, so the text no
    longer reads as the commands' answers.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    # Every way to read the text so far, by the line it reached: how many ways (capped at 2),
    # and the line the last answer began at with its text, to walk back from the end.
    ways: dict[int, int] = {0: 1}
    steps: list[dict[int, tuple[int, str]]] = []
    for command in commands:
        shape = answer_shape(command)
        following: dict[int, int] = {}
        back: dict[int, tuple[int, str]] = {}
        for at, count in ways.items():
            for reached, answer in _readings(shape, lines, at):
                following[reached] = min(2, following.get(reached, 0) + count)
                back.setdefault(reached, (at, answer))
        if not following:
            return None
        ways = following
        steps.append(back)
    if ways.get(len(lines)) != 1:
        return None
    answers: list[str] = []
    at = len(lines)
    for back in reversed(steps):
        at, answer = back[at]
        answers.append(answer)
    answers.reverse()
    return answers
