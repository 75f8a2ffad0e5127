"""docs/PROTOCOL.md §19.5's test vectors are what the project computes, line for line: the
document cannot drift from the implementation (``python -m edgepfl.protocol.secagg_vectors``
prints the block). The second implementation, written from the text, is checked against the
same block in ``test_secagg_from_the_text.py``."""

from __future__ import annotations

import re
from pathlib import Path

from edgepfl.protocol.secagg_vectors import lines

PROTOCOL = Path(__file__).resolve().parents[3] / "docs" / "PROTOCOL.md"


def document_block() -> list[str]:
    text = PROTOCOL.read_text()
    match = re.search(r"<!-- secagg vectors: begin -->\n```text\n(.*?)```\n<!-- secagg vectors: end -->", text, re.S)
    assert match, "PROTOCOL.md §19.5 has no vectors block"
    return match.group(1).splitlines()


def test_the_documents_vectors_are_the_projects_line_for_line():
    assert document_block() == list(lines())


def test_the_vectors_show_two_share_keys_per_edge_and_a_sum_that_is_the_survivors_contributions():
    block = dict(line.split(" = ", 1) for line in document_block())
    assert block["share key agent-a to agent-b"] != block["share key agent-b to agent-a"]
    contributions = [block[f"{a} contribution v"] for a in ("agent-a", "agent-b", "agent-d")]
    words = [[int.from_bytes(bytes.fromhex(v)[i:i + 8], "little", signed=True) for i in range(0, len(v) // 2, 8)]
             for v in contributions]
    assert [int(x) for x in block["unmasked sum (int64)"].split()] == [sum(c) for c in zip(*words)]
