"""The README and docs/: every relative link leads to a file and heading that exist, the
module map in docs/architecture.md names every module under supervisor/ and no other, and
the guard block that docs/steering.md shows is the one the daemon injects."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rigs.wholes import guard_block

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]: *<?([^>\s]+)>?", flags=re.M)


def prose(text: str) -> str:
    """The page without its code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, spaces to hyphens, other
    punctuation dropped, a repeated heading numbered from -1."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(page: Path) -> list[str]:
    """Inline links and reference definitions, but those with a scheme (https:, mailto:)."""
    text = prose(page.read_text())
    return [target for target in LINK.findall(text) + REFERENCE.findall(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `page` whose file, or heading in it, does not exist."""
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(root)}")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked.read_text())):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page: Path):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_a_broken_link_is_reported(tmp_path: Path):
    """The control: a page whose links miss a file, a heading in another page, a heading of
    its own, or hide behind a reference definition, is reported once per broken link."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Its part\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Front\n\n"
        "[fine](docs/other.md#its-part), [fine too](#front), [web](https://example.com/x.md)\n"
        "[gone](docs/missing.md), [no part](docs/other.md#no-such-part), [no heading](#nowhere)\n"
        "[by reference][ref]\n\n[ref]: docs/also-missing.md\n"
    )
    assert broken_links(page, tmp_path) == [
        "docs/missing.md: no file docs/missing.md",
        "docs/other.md#no-such-part: no heading #no-such-part in docs/other.md",
        "#nowhere: no heading #nowhere in README.md",
        "docs/also-missing.md: no file docs/also-missing.md",
    ]


def module_map() -> dict[str, str]:
    """docs/architecture.md's module table: the first cell (a module, or a package ending in
    `/`) to the text of the row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w/.]+)` \|.*$", text, flags=re.M)}


def test_the_module_map_names_every_module_and_no_other():
    package = ROOT / "supervisor"
    modules = {str(path.relative_to(package)) for path in package.rglob("*.py")
               if path.name not in {"__init__.py", "__main__.py"}}
    rows = module_map()
    named = {name for name in rows if name.endswith(".py")}
    for name, row in rows.items():
        if name.endswith("/"):
            assert (package / name).is_dir(), f"the module map names {name}, which is not a package"
            # A package's row names its modules as `x.py`, or by what they hold: `x.Name`.
            named |= {name + module for module in re.findall(r"`(\w+\.py)`", row)}
            named |= {name + module + ".py" for module in re.findall(r"`(\w+)\.\w+", row)
                      if (package / name / f"{module}.py").exists()}
    assert sorted(modules - named) == [], "modules the map does not name"
    assert sorted(named - modules) == [], "modules the map names that do not exist"


def test_links_are_found_and_a_broken_one_is_caught(tmp_path: Path):
    assert len(relative_links(ROOT / "README.md")) > 10
    assert "haproxys-messages-and-the-journal" in anchors((ROOT / "docs" / "operating.md").read_text())
    assert "the-haproxy-supervisor-status-command" in anchors((ROOT / "docs" / "status.md").read_text())
    page = tmp_path / "page.md"
    page.write_text("# A `b`'s c\n\nsee [here](#a-bs-c), [there](#nowhere), [file](missing.md)\n"
                    "`[not a link](x.md)`\n")
    assert anchors(page.read_text()) == {"a-bs-c"}
    assert relative_links(page) == ["#a-bs-c", "#nowhere", "missing.md"]


def test_the_guard_block_in_steering_md_is_the_injected_one():
    text = (ROOT / "docs" / "steering.md").read_text()
    section = text.split("\n## The guard\n", 1)[1].split("\n## ", 1)[0]
    shown = re.search(r"^```\n(.*?)^```", section, flags=re.M | re.S).group(1).splitlines()
    injected = [
        "    " + line.replace("/RUNTIME_DIR/", "<runtime_dir>/").replace("slots-HASH", "slots-<hash>")
        for line in guard_block("http", "/RUNTIME_DIR/steer.map", "/RUNTIME_DIR/slots-HASH.map")
    ]
    assert shown == injected
