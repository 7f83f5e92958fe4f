"""The shape of the code as the team keeps it: no module in supervisor/, tests/ or bench/ so long
that it must mix subjects, no function in supervisor/ that only the tests or the benchmarks
call (those live in rigs/ or tests/support/), and no import cycle in supervisor/. A module holds one
whole idea, however long: the bound is for a file that has grown into several, not a size to
cut ideas to."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.support.call_path import module_imports

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 1200


def names_used(root: Path) -> Counter[str]:
    """Every name a module under `root` refers to: loaded, read as an attribute, imported, or
    given as a string (a hook called by its name)."""
    used: Counter[str] = Counter()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                used[node.id] += 1
            elif isinstance(node, ast.Attribute):
                used[node.attr] += 1
            elif isinstance(node, ast.alias):
                used[(node.asname or node.name).rsplit(".", 1)[-1]] += 1
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                used[node.value] += 1
    return used


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_supervisor():
    graph = module_imports(ROOT / "supervisor")
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the graph was read
    assert cycles(graph) == []


def test_no_module_mixes_subjects_by_its_length():
    long = {str(p.relative_to(ROOT)): n for tree in ("supervisor", "rigs", "tests", "bench")
            for p in (ROOT / tree).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert long == {}


def test_no_function_in_supervisor_is_called_only_by_tests_or_benchmarks():
    """Control: thirteen such functions before rigs/wholes.py took them."""
    product = names_used(ROOT / "supervisor")
    elsewhere = names_used(ROOT / "tests") + names_used(ROOT / "bench") + names_used(ROOT / "rigs")
    only_there: list[str] = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = node.name
                if not name.startswith("__") and product[name] == 0 and elsewhere[name] > 0:
                    only_there.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert only_there == []
