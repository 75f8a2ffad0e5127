"""Every link between the documents resolves: the file exists and, for a ``#fragment``,
the target has a heading (GitHub's slug) or an explicit anchor of that name. The
documents cross-reference sections by anchor (PROTOCOL.md §-links, the BENCHMARKS index),
and a renamed heading otherwise breaks them silently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "research").glob("*.md")])

LINK = re.compile(r"\]\(([^)\s]*?)(?:#([^)\s]+))?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    names = {slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}
    return names | set(re.findall(r'<a (?:name|id)="([^"]+)"', text))


def links(path: Path) -> list[tuple[str, str | None]]:
    return [(target, fragment) for target, fragment in LINK.findall(FENCE.sub("", path.read_text()))
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto: are not ours to check


def test_the_slug_follows_github():
    assert slug("Fleet view cost at 1,000 agents") == "fleet-view-cost-at-1000-agents"
    assert slug("DualFed's personal BN statistics (seed 13)") == "dualfeds-personal-bn-statistics-seed-13"
    assert slug("3a. Signatures") == "3a-signatures"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_link_of_a_document_resolves(document):
    broken = []
    for target, fragment in links(document):
        path = (document.parent / target).resolve() if target else document
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}#{fragment} (no such heading)")
    assert not broken, f"{document.name}: " + "; ".join(broken)
