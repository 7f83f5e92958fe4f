"""The README and docs/: every relative link leads to a file and heading that exist, and the
guard block that docs/steering.md shows is the one the daemon injects."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.wholes import guard_block

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


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
    return [target for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page: Path):
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT)}")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked.read_text())):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


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
