"""The conformance kit in process: its verdicts (a newer requirement is skipped for an older
agent, a failed SHOULD leaves it conformant), docs/CONFORMANCE.md lists exactly the kit's
checks, and the command is registered.

The kit against real agent processes and a real Mosquitto:
tests/integration/agent/test_conformance_kit_live.py.
"""

from __future__ import annotations

import re

from edgepfl.conformance import CHECKS, Report

from tests.conftest import REPO_ROOT


def test_a_newer_requirement_is_skipped_for_an_older_agent():
    report = Report(agent_cmd="x", protocol="1.2", agent_version="1.1")
    report.record("refusal.data_mismatch", False, "no refusal (silence)")
    report.record("refusal.data_mismatch.silent", False, "answered with an update")
    assert report.results["refusal.data_mismatch"].verdict == "skip"
    assert report.results["refusal.data_mismatch.silent"].verdict == "fail"
    assert not report.conformant
    assert "NOT CONFORMANT" in report.table()


def test_a_failed_should_leaves_the_agent_conformant():
    report = Report(agent_cmd="x", protocol="1.2", agent_version="1.2")
    report.record("presence.capabilities", False, "capabilities None")
    report.record("task.train", True, "answered")
    report.record("task.train", False, "a later verdict does not replace the first")
    assert report.results["task.train"].verdict == "pass"
    assert report.conformant


def test_docs_list_every_check_with_its_section_and_level():
    text = (REPO_ROOT / "docs" / "CONFORMANCE.md").read_text()
    pattern = r"^\| `([a-z0-9_.]+)` \| \[(§\w+)\]\(PROTOCOL\.md#[^)]+\) \| (MUST|SHOULD) \|"
    rows = {m[0]: (m[1], m[2]) for m in re.findall(pattern, text, re.M)}
    assert rows == {c.id: (c.section, c.level) for c in CHECKS.values()}


def test_cli_registers_the_command():
    from edgepfl.cli import DELEGATES

    assert ("conformance", "edgepfl.conformance.cli:main_conformance") in [(n, t) for n, t, _ in DELEGATES]


def test_the_probes_score_everything_for_a_right_agent_and_near_chance_for_each_break(tmp_path):
    """task.preprocessing and task.class_order tell breaks apart only if the kit's trained
    model is right on every sample and far below MIN_ACCURACY under each break."""
    from edgepfl.conformance.kit import _Kit
    from edgepfl.conformance.probes import MIN_ACCURACY, discrimination
    from edgepfl.conformance.wire import write_dataset

    data = tmp_path / "data.npz"
    run = _Kit.run_spec(write_dataset(data))
    scored = discrimination(run, data)
    assert scored["right"] == 1.0 and scored["class order, mapped"] == 1.0
    for broken in ("x / 255 only", "the file's normalization", "class order, local numbers"):
        assert scored[broken] <= MIN_ACCURACY - 0.4, (broken, scored)
