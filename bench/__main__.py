"""`make bench`: run every benchmark module in bench/ and rewrite docs/benchmarks.md's figures.

    python -m bench                     # every module, its make-bench configuration; writes the doc
    python -m bench --quick --doc COPY  # small sizes, into a copy of the doc (a smoke test)
    python -m bench drain fidelity      # the named modules only, printed, the doc left alone
    python -m bench --doc COPY drain    # the named modules, written into COPY's sections

Each module's `section(quick)` returns its table (markdown); it runs in a process of its own
(bench/_one.py). A module that fails leaves a one-line error in its section, the others still
run, and the exit status is 1. The doc's markers are checked before anything runs.
"""

from __future__ import annotations

import argparse
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._doc import (
    DOC,
    FRONT_DOOR,
    ROOT,
    RUN,
    SectionError,
    check_sections,
    failed_section,
    replace_sections,
    section_names,
    shared_sections,
    this_run,
)
from rigs.harness import haproxy_binary

# The three-way drain table is the headline: it comes first.
HEADLINE = "drain"


def modules() -> list[str]:
    """Every benchmark module in bench/, the headline first."""
    found = [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if not m.name.startswith("_")]
    return sorted(found, key=lambda name: (name != HEADLINE, name))


def run_one(name: str, quick: bool, scratch: Path) -> tuple[str | None, str]:
    """(the section, None) or (None, the one-line reason it failed)."""
    out = scratch / f"{name}.md"
    command = [sys.executable, "-m", "bench._one", name, str(out)] + (["--quick"] if quick else [])
    code = subprocess.run(command, cwd=ROOT).returncode
    if code == 0 and out.exists():
        return out.read_text(), ""
    error = Path(f"{out}.error")
    return None, error.read_text() if error.exists() else f"exited with status {code}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="modules to run and print (default: all, and write the doc)")
    parser.add_argument("--quick", action="store_true", help="each module's small configuration")
    parser.add_argument("--doc", type=Path, help=f"the doc to rewrite (default {DOC}, when no module is named)")
    args = parser.parse_args(argv)
    known = modules()
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"no benchmark module {', '.join(unknown)} in bench/ (there are: {', '.join(known)})")
    doc = args.doc or (None if args.names else DOC)
    names = args.names or known
    sections: dict[str, str] = {}
    if doc is not None:
        try:
            check_sections(doc.read_text(), [RUN, *names])
            if doc == DOC:
                front = FRONT_DOOR.read_text()
                check_sections(front, section_names(front))
        except SectionError as error:
            parser.error(f"{doc}: {error}")
        # The tree as the benchmarks run it, taken before they start.
        sections[RUN] = this_run(ROOT, os.environ.get("HAPROXY_BIN") or haproxy_binary(), args.quick)
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hs-bench-doc-") as scratch:
        for name in names:
            print(f"== bench.{name}", flush=True)
            started = time.monotonic()
            body, error = run_one(name, args.quick, Path(scratch))
            took = time.monotonic() - started
            if body is None:
                failed.append(name)
                body = failed_section(name, error)
            print(body, flush=True)
            print(f"== bench.{name}: {'failed' if name in failed else 'done'} in {took:.0f} s", flush=True)
            sections[name] = body
    if doc is not None:
        # Read again: the doc's prose may have been edited while the benchmarks ran.
        doc.write_text(replace_sections(doc.read_text(), sections))
        print(f"wrote {doc}", flush=True)
        if doc == DOC:  # make bench: the README's headline tables come from the same run
            FRONT_DOOR.write_text(shared_sections(FRONT_DOOR.read_text(), sections))
            print(f"wrote {FRONT_DOOR}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
