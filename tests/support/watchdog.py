"""Print every asyncio task's stack shortly before pytest-timeout fails a test.

pytest-timeout's own dump shows threads only, and a hung asyncio test shows one thread
waiting in `select`; the tasks' stacks say which await never returned.
"""

from __future__ import annotations

import asyncio
import gc
import io
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def task_stacks() -> str:
    out = io.StringIO()
    tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
    out.write(f"{len(tasks)} asyncio tasks pending\n")
    for task in tasks:
        out.write(f"--- {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(file=out)
    return out.getvalue()


@contextmanager
def dump_tasks_after(seconds: float) -> Iterator[None]:
    def dump() -> None:
        sys.stderr.write(f"\n=== still running after {seconds:.0f}s; asyncio tasks:\n{task_stacks()}")
        sys.stderr.flush()

    timer = threading.Timer(seconds, dump)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
