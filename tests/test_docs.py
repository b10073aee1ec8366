"""The README stays a guide (at most 300 lines) and its links, and those of docs/*.md, resolve: every docs file the
README links to exists, and every relative link in the README and docs/ names a file (and, with a #fragment, a
heading of that file) that is there."""

from __future__ import annotations

import importlib.util
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


# A dotted name of kvlab's, as code, docs and config comments cite one: `kvlab.engine.sample`, kvlab.state.jobs.eval_mem_mb.
# Not one that is part of a path or file name (results/kvlab.duckdb); not a profiler label (record_function("kvlab.prefill")).
DOTTED = re.compile(r"(?<![\w./-])kvlab(?:\.[A-Za-z_]\w*)+")
LABEL = re.compile(r"""record_function\(["']kvlab\.\w+["']\)""")
CITING = [*sorted((ROOT / "src").rglob("*.py")), *DOCS, README, ROOT / "config.yaml"]


def resolves(name: str) -> bool:
    """Whether `name` is a kvlab module, or an attribute (a chain of them) of the longest module it starts with."""
    first, *rest = name.split(".")
    obj, path = importlib.import_module(first), first
    for part in rest:
        path = f"{path}.{part}"
        if hasattr(obj, "__path__") and importlib.util.find_spec(path) is not None:  # a submodule of a package
            obj = importlib.import_module(path)
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            return False
    return True


def test_every_kvlab_dotted_name_resolves():
    """Every `kvlab.…` name in src/, docs/, the README and config.yaml is a module or an attribute that exists."""
    bad = []
    for path in CITING:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in DOTTED.findall(LABEL.sub("", line)):
                if not resolves(name):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert not bad, "names that do not resolve:\n" + "\n".join(bad)


def test_the_dotted_name_check_finds_a_bad_name(tmp_path):
    """The check above tells a real name from a stale one (a module, an attribute, a nested attribute)."""
    assert resolves("kvlab.engine") and resolves("kvlab.engine.attention.query_hooks")
    assert resolves("kvlab.kernels.accounting.Scheme.parse")
    assert not resolves("kvlab.methods.h2o.query_hooks") and not resolves("kvlab.no_such_module")
    assert DOTTED.findall('see `kvlab.state.jobs.eval_mem_mb`. In results/kvlab.duckdb') == ["kvlab.state.jobs.eval_mem_mb"]
    assert DOTTED.findall(LABEL.sub("", '@record_function("kvlab.prefill")')) == []


# A section another file cites by its heading: README "Your workload in three steps", docs/statistics.md "Evidence in rounds".
SECTION = re.compile(r"""(README|docs/\w+\.md),? ["“]([^"”]+)["”]""")


def test_every_cited_section_is_a_heading_of_its_file():
    """Config comments, code and docs that send a reader to a section by name name a heading that is there."""
    headings = {f"{p.relative_to(ROOT)}": set(re.findall(r"^#+ (.+)$", p.read_text(), flags=re.M)) for p in [README, *DOCS]}
    headings["README"] = headings.pop("README.md")
    bad = []
    for path in CITING:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for file, section in SECTION.findall(line):
                if section not in headings.get(file, ()):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {file} \"{section}\"")
    assert not bad, "sections cited that are not headings there:\n" + "\n".join(bad)



def test_readme_lines_are_at_most_120_characters():
    long = [f"README.md:{n}: {len(line)} characters" for n, line in enumerate(README.read_text().splitlines(), 1)
            if len(line) > 120]
    assert not long, "\n".join(long)
