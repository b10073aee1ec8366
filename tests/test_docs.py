"""The README stays a guide (at most 300 lines) and its links, and those of docs/*.md, resolve: every docs file the
README links to exists, and every relative link in the README and docs/ names a file (and, with a #fragment, a
heading of that file) that is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside code blocks and inline code."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_links_each_docs_file_and_they_exist():
    targets = {t.split("#")[0] for t in links(README)}
    named = {t for t in targets if t.startswith("docs/")}
    assert {"docs/engine.md", "docs/statistics.md", "docs/benchmarks.md"} <= named, named
    assert all((ROOT / t).is_file() for t in named), [t for t in named if not (ROOT / t).is_file()]
    assert {f"docs/{p.name}" for p in DOCS} <= named, "a docs file the README does not link to"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path):
    broken = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            broken.append(target)
        elif fragment and where.suffix == ".md" and fragment not in anchors(where):
            broken.append(target)
    assert not broken, broken
