"""Run every benchmark module in bench/ (or the ones named on the command line)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

# The three-way drain table is the headline: it comes first.
HEADLINE = "drain"


def main(argv: list[str]) -> int:
    here = Path(__file__).parent
    found = [m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_")]
    names = argv or sorted(found, key=lambda name: (name != HEADLINE, name))
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        print(f"== bench.{name}", flush=True)
        # Each module's main() reads its options from sys.argv: none here, its defaults.
        sys.argv = [f"bench.{name}"]
        module.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
