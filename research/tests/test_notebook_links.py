"""research/'s documents link only to what exists: files (scripts, results, plots) and, for a
``#fragment`` into a markdown file, a heading of that name (GitHub's slug). The product's
documents have the same check (tests/test_doc_links.py); this one covers research/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

RESEARCH = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted(RESEARCH.glob("*.md"))

LINK = re.compile(r"\]\(([^)\s]*?)(?:#([^)\s]+))?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    text = re.sub(r"`|\*\*", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)} | set(
        re.findall(r'<a (?:name|id)="([^"]+)"', text))


def test_research_has_its_notebook_and_readme():
    assert {p.name for p in DOCUMENTS} >= {"README.md", "RESULTS.md"}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_link_of_a_research_document_resolves(document):
    broken = []
    for target, fragment in LINK.findall(FENCE.sub("", document.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path = (document.parent / target).resolve() if target else document
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}#{fragment} (no such heading)")
    assert not broken, f"{document.name}: " + "; ".join(broken)


def test_the_notebook_names_result_folders_that_exist():
    """Every ``research/results/<name>`` the notebook cites is there (the file names under a
    folder are sometimes patterns: ``diagnose_S_cC.json``, ``<setting>__<method>``)."""
    text = (RESEARCH / "RESULTS.md").read_text()
    cited = set(re.findall(r"research/results/([\w=+-]+)", text))
    missing = [c for c in sorted(cited) if not list((RESEARCH / "results").glob(c + "*"))]
    assert cited and not missing, missing
