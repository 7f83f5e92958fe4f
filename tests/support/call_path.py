"""A config change followed call by call through the real daemon, in-process (issue #34): every
call into a supervisor module that is handed the new config (its `Effective`, the models in it,
or the generation that records it) under the reloader's `_change`, in order. From that path, how
often the change enters a module it had already entered, and whether a call goes up: from a
module into one that imports it, a lower layer calling a higher one back.

Run in a network namespace of its own (rigs/netns.py): HAProxy on loopback, three servers."""

from __future__ import annotations

import ast
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from rigs.daemon import Daemon as DaemonFiles
from rigs.harness import backends, free_port

PACKAGE = Path(__file__).resolve().parents[2] / "supervisor"
ENTRY = "_change"  # the reloader's one change, under master.lock
# The slices' driver runs a generator for its caller: a call through it is its caller's.
TRANSPARENT = "supervisor.eventloop"

CONFIG = """\
global
    hard-stop-after 10s
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend fe
    bind 127.0.0.1:{front}
    default_backend app
backend app
    balance roundrobin
    server s1 127.0.0.1:{first} check inter 1s
    server s2 127.0.0.1:{second} check inter 1s
"""


def module_imports(root: Path) -> dict[str, set[str]]:
    """{module: the modules of `root`'s package it imports}, every import counted: inside a
    function or under TYPE_CHECKING too, since either still ties the two modules together."""
    package = root.name
    modules: dict[str, tuple[ast.Module, tuple[str, ...]]] = {}
    for path in root.rglob("*.py"):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            inside = parts
        else:
            inside = parts[:-1]
        modules[".".join(parts)] = (ast.parse(path.read_text()), inside)
    graph: dict[str, set[str]] = {}
    for name, (tree, inside) in modules.items():
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(inside[: len(inside) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def imported_by_each(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{module: every module it imports, directly or not}."""
    closure: dict[str, set[str]] = {}

    def reach(module: str) -> set[str]:
        if module not in closure:
            closure[module] = set()
            for target in graph.get(module, ()):
                closure[module] |= {target} | reach(target)
        return closure[module]

    for module in graph:
        reach(module)
    return closure


def module_of(filename: str) -> str | None:
    try:
        parts = Path(filename).resolve().relative_to(PACKAGE).with_suffix("").parts
    except ValueError:
        return None
    return ".".join(("supervisor", *parts)).removesuffix(".__init__")


def _under_entry(frame: FrameType) -> bool:
    found: FrameType | None = frame
    while found is not None:
        if found.f_code.co_name == ENTRY and module_of(found.f_code.co_filename):
            return True
        found = found.f_back
    return False


async def _followed(directory: Path) -> list[tuple[str | None, str, str]]:
    from supervisor.daemon import Daemon
    from supervisor.effective import Effective
    from supervisor.settings import load_settings
    from supervisor.state import Generation

    with backends("a", "b", "c") as servers:
        front = free_port()
        ports = {name: s.port for name, s in servers.items()}
        files = DaemonFiles(directory, CONFIG.format(front=front, first=ports["a"], second=ports["b"]),
                            {"old_workers": {"guard": True}})
        daemon = Daemon(load_settings(files.settings_path))
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + 30
        while daemon.state.current is None:
            assert time.monotonic() < deadline and not running.done(), "the daemon did not start"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        marker = f"127.0.0.1:{ports['c']}"
        new_config: set[int] = set()
        started: set[FrameType] = set()
        calls: list[tuple[str | None, str, str]] = []

        def profile(frame: FrameType, event: str, _: Any) -> None:
            if event != "call" or frame in started:  # a coroutine or generator resumed, not called
                return
            callee = module_of(frame.f_code.co_filename)
            if callee is None:
                return
            started.add(frame)
            code = frame.f_code
            handed = False
            for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
                value = frame.f_locals.get(name)
                if isinstance(value, Effective) and marker in value.text:
                    new_config.update({id(value), id(value.effective_model)})
                elif isinstance(value, Generation) and id(value.model) in new_config:
                    new_config.add(id(value))
                handed = handed or (value is not None and id(value) in new_config)
            if not handed or not _under_entry(frame):
                return
            back = frame.f_back
            while back is not None and module_of(back.f_code.co_filename) == TRANSPARENT:
                back = back.f_back
            calls.append((module_of(back.f_code.co_filename) if back else None, callee, code.co_qualname))

        sys.setprofile(profile)
        try:
            files.rendered.write_text(CONFIG.format(front=front, first=ports["a"], second=ports["c"]))
            deadline = time.monotonic() + 30
            while (daemon.state.current is None or daemon.state.current.number < 2) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # the steering's rounds after the reload
        finally:
            sys.setprofile(None)
        daemon.handle_stop("SIGTERM")
        await asyncio.wait_for(running, 30)
        return calls


def follow_a_reload() -> dict[str, list[tuple[str | None, str, str]]]:
    """The path of one reload's new config (caller module, callee module, callee), its calls
    into a module it had already entered, and its calls up."""
    with tempfile.TemporaryDirectory(prefix="hs-path-") as tmp:
        calls = asyncio.run(_followed(Path(tmp)))
    imports = imported_by_each(module_imports(PACKAGE))
    path = [(caller, callee, name) for caller, callee, name in calls if caller != callee]
    entered: set[str] = set()
    again, up = [], []
    for caller, callee, name in path:
        if callee in entered:
            again.append((caller, callee, name))
        entered.add(callee)
        if caller is not None and caller in imports.get(callee, set()):
            up.append((caller, callee, name))
    return {"path": path, "again": again, "up": up}
