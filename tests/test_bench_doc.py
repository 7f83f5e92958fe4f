"""`make bench` writes docs/benchmarks.md: the sections between markers, the run's line, a failed
module's line, and one section per benchmark module."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench.__main__ as runner
from bench._doc import (
    DOC,
    FRONT_DOOR,
    RUN,
    SectionError,
    check_sections,
    failed_section,
    markdown_table,
    replace_sections,
    run_line,
    section_names,
    shared_sections,
)

ROOT = Path(__file__).resolve().parents[1]

DOC_TEXT = """# Title

Prose before, with a `<!-- bench:x -->` quoted inline.

<!-- bench:run -->
old line
<!-- /bench:run -->

## A

<!-- bench:alpha -->
| old | table |
| --- | --- |
| 1 | 2 |
<!-- /bench:alpha -->
Prose after alpha, kept.

<!-- bench:beta -->
beta's old figures
<!-- /bench:beta -->

Trailing prose, no newline at the end"""


def test_a_section_is_replaced_and_the_rest_kept_byte_for_byte():
    new = replace_sections(DOC_TEXT, {"alpha": "| new |\n| --- |\n| 3 |\n"})
    before, after = DOC_TEXT.split("| old | table |\n| --- | --- |\n| 1 | 2 |")
    assert new == before + "| new |\n| --- |\n| 3 |" + after
    assert replace_sections(DOC_TEXT, {}) == DOC_TEXT


def test_every_named_section_is_replaced_in_one_pass():
    new = replace_sections(DOC_TEXT, {RUN: "the run", "alpha": "A", "beta": "B"})
    assert "<!-- bench:run -->\nthe run\n<!-- /bench:run -->" in new
    assert "<!-- bench:alpha -->\nA\n<!-- /bench:alpha -->\nProse after alpha, kept." in new
    assert "<!-- bench:beta -->\nB\n<!-- /bench:beta -->" in new
    assert "old" not in new
    # Replacing again with the same bodies changes nothing: the markers stay where they were.
    assert replace_sections(new, {RUN: "the run", "alpha": "A", "beta": "B"}) == new


def test_section_names_are_the_marker_lines_only():
    assert section_names(DOC_TEXT) == [RUN, "alpha", "beta"]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (DOC_TEXT, "section 'gamma': the doc has no `<!-- bench:gamma -->` lines, it needs one"),
        (DOC_TEXT.replace("<!-- /bench:beta -->", ""), "section 'beta': `<!-- bench:beta -->` needs one"),
        (DOC_TEXT + "\n<!-- bench:beta -->\nagain\n<!-- /bench:beta -->\n", "section 'beta': the doc has 2"),
    ],
)
def test_a_missing_repeated_or_unclosed_marker_is_a_clear_error(doc, message):
    name = message.split("'")[1]
    with pytest.raises(SectionError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        replace_sections(doc, {name: "x"})
    with pytest.raises(SectionError):
        check_sections(doc, [name])


def test_a_failed_module_leaves_one_line_naming_it_and_why():
    line = failed_section("drain", "RuntimeError: HAProxy refused\n  the config\n")
    assert line == "**bench.drain failed in this run:** RuntimeError: HAProxy refused the config"
    assert "\n" not in line


def test_markdown_table_and_run_line():
    assert markdown_table(["a", "b"], [(1, "x")]) == "| a | b |\n| --- | --- |\n| 1 | x |"
    line = run_line("abc1234", True, "HAProxy version 2.6.12", "3.11.2", 2, "2026-12-01 15:00 UTC")
    assert "`abc1234`, with uncommitted changes" in line and "HAProxy version 2.6.12" in line
    assert "Python 3.11.2" in line and "2 CPUs" in line and "2026-12-01" in line
    assert "uncommitted" not in run_line("abc1234", False, "h", "p", 2, "d")
    assert "--quick" in run_line("abc1234", False, "h", "p", 2, "d", quick=True)


def test_every_module_has_a_section_in_the_doc_and_every_section_a_module():
    sections = section_names(DOC.read_text())
    assert sections[0] == RUN
    assert sorted(sections[1:]) == sorted(runner.modules())
    assert len(set(sections)) == len(sections)
    check_sections(DOC.read_text(), sections)
    for name in runner.modules():
        assert callable(importlib.import_module(f"bench.{name}").section), name


def test_the_readme_carries_only_module_sections_and_make_bench_fills_them():
    """The front door's headline tables are the doc's sections of the same names, from one run."""
    front = FRONT_DOOR.read_text()
    names = section_names(front)
    assert names and set(names) <= set(runner.modules()), names
    check_sections(front, names)
    filled = shared_sections(front, {name: f"table of {name}" for name in [*names, "not_in_the_readme"]})
    for name in names:
        assert f"<!-- bench:{name} -->\ntable of {name}\n<!-- /bench:{name} -->" in filled
    assert "not_in_the_readme" not in filled
    assert filled != front


def test_a_module_that_raises_reports_its_reason(tmp_path):
    body, error = runner.run_one("no_such_benchmark", False, tmp_path)
    assert body is None
    assert error == "ModuleNotFoundError: No module named 'bench.no_such_benchmark'"


def test_the_run_goes_on_past_a_failed_module_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "benchmarks.md"
    copy.write_text(DOC.read_text())
    names = runner.modules()[:2]

    def one(name: str, quick: bool, scratch: Path) -> tuple[str | None, str]:
        return (None, "RuntimeError: boom") if name == names[0] else (f"table of {name}", "")

    monkeypatch.setattr(runner, "run_one", one)
    assert runner.main(["--doc", str(copy), *names]) == 1
    text = copy.read_text()
    assert f"**bench.{names[0]} failed in this run:** RuntimeError: boom" in text
    assert f"<!-- bench:{names[1]} -->\ntable of {names[1]}\n<!-- /bench:{names[1]} -->" in text
    assert "failed: " + names[0] in capsys.readouterr().err


def test_a_doc_without_the_markers_stops_the_run_before_any_benchmark(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "benchmarks.md"
    copy.write_text(DOC.read_text().replace("<!-- bench:drain -->", "<!-- drain -->"))
    monkeypatch.setattr(runner, "run_one", lambda *a: pytest.fail("a benchmark ran"))
    with pytest.raises(SystemExit) as stopped:
        runner.main(["--doc", str(copy), "drain"])
    assert stopped.value.code == 2
    assert "section 'drain': the doc has no `<!-- bench:drain -->` lines" in capsys.readouterr().err


def test_make_bench_writes_a_real_module_into_a_copy_of_the_doc(tmp_path):
    """End to end: `python -m bench --quick --doc COPY status_page` runs the module in its own
    process and rewrites the copy's section and run line; the committed doc is not touched."""
    copy = tmp_path / "benchmarks.md"
    original = DOC.read_text()
    copy.write_text(original)
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin"}
    done = subprocess.run([sys.executable, "-m", "bench", "--quick", "--doc", str(copy), "status_page"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    text = copy.read_text()
    head = text.split("<!-- bench:status_page -->\n")[1].split("\n<!-- /bench:status_page -->")[0]
    assert head.startswith("| 1,000 dead of 10,000 servers, 50 old workers | median ms | p90 ms | runs |")
    assert "| `GET /` over HTTP (" in head
    run = text.split("<!-- bench:run -->\n")[1].split("\n<!-- /bench:run -->")[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert f"`{commit.stdout.strip()}`" in run and "--quick" in run and "HAProxy version" in run
    # Everything outside those two sections is as it was.
    untouched = replace_sections(text, {RUN: "", "status_page": ""})
    assert untouched == replace_sections(original, {RUN: "", "status_page": ""})
    assert DOC.read_text() == original
