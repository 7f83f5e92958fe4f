"""One benchmark's section, in a process of its own: `python -m bench._one NAME OUT [--quick]`.

bench/__main__.py starts one of these per module, so that no module's heap, signal handlers
or patched functions reach the next. The module's `section()` result goes to OUT; if it
raises, OUT + ".error" gets the one-line reason and the exit status is 1.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    name, out, quick = argv[0], Path(argv[1]), "--quick" in argv[2:]
    try:
        module = importlib.import_module(f"bench.{name}")
        body = module.section(quick=quick)
    except BaseException as error:  # any failure becomes the section's line, and the run goes on
        traceback.print_exc()
        Path(f"{out}.error").write_text(f"{type(error).__name__}: {error}")
        return 1
    out.write_text(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
