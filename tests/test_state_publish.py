"""State is a read model: the modules that own its facts write them only through State's
publish_* methods. Checked on the source, so a write added anywhere in them fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from supervisor.state import Generation, PendingRemoval

ROOT = Path(__file__).resolve().parent.parent / "supervisor"
# Every module but the read model itself: owners publish, status and the page only read.
OWNERS = sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "state.py")
MUTATORS = {"append", "add", "pop", "clear", "update", "discard", "remove", "setdefault", "record", "missed",
            "reached", "observe", "note_old_workers", "popitem", "extend"}


def _through_state(node: ast.expr) -> bool:
    """Is `node` `state.<...>` or `<...>.state.<...>` (a field of State, however reached)?"""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        inner = node.value
        if isinstance(inner, ast.Name) and inner.id == "state" and node is not inner:
            return True
        if isinstance(inner, ast.Attribute) and inner.attr == "state":
            return True
        node = inner
    return False


def writes_into_state(source: str) -> list[str]:
    """Every assignment into a State field, and every mutating call on one, as source lines."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        found += [ast.unparse(node) for t in targets if _through_state(t)]
    return found


def test_the_check_finds_every_kind_of_write():
    # The control: each of these is a write the rule forbids, as the modules made them before.
    assert writes_into_state("self.state.master_up = True") == ["self.state.master_up = True"]
    assert writes_into_state("self.state.master_restarts += 1")
    assert writes_into_state("self.state.generations[3] = g")
    assert writes_into_state("self.state.generations.pop(3)")
    assert writes_into_state("self.state.convergence.missed('x', transient=True)")
    assert writes_into_state("state.rendered_path = 'p'")
    assert writes_into_state("self.state.convergence.next_attempt_at = None")
    assert not writes_into_state("self.state.publish_master(3)\nx = self.state.current\nstate = State()")


@pytest.mark.parametrize("path", OWNERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_owners_write_state_only_by_publishing(path: Path):
    assert writes_into_state(path.read_text()) == []


def test_a_generation_is_a_value():
    generation = Generation(1, None, "e", "r", None)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        generation.model = None  # type: ignore[misc]


def test_a_pending_removal_is_a_value():
    removal = PendingRemoval("b/s", 1, None, 0.0)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        removal.tries = 2  # type: ignore[misc]
