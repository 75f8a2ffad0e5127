"""The conformance kit: the project's agent passes every check (broken agents fail the
matching checks: the mutation suite, tests/integration/test_conformance_mutants.py; the
kit's verdicts and docs/CONFORMANCE.md's list in process: tests/contract/test_conformance.py).

The kit runs real agent processes against a real Mosquitto (edgepfl.testing); the
end-to-end runs are slow (the whole kit about 1 to 3 minutes on a loaded 2-core box).
tests/integration/test_foreign_agent.py runs the kit against
the agent written from the documents alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgepfl.conformance import CHECKS
from edgepfl.conformance.cli import main_conformance

from tests.conftest import require_mosquitto

AGENT_CMD = "{python} -m edgepfl agent --config {config}"

#: 1.2 behaviour the project's agent does not implement yet in this branch: each check is
#: expected to fail until the named feature lands (then the xfail turns into an XPASS)
PENDING = {
}


def _param(check_id: str):
    if check_id in PENDING:
        return pytest.param(check_id, marks=pytest.mark.xfail(
            strict=False, reason=f"expected to fail until {PENDING[check_id]} lands"))
    return check_id


def _run(tmp: Path, agent_cmd: str, *skip: str) -> tuple[int, dict]:
    out = tmp / "report.json"
    argv = ["--agent-cmd", agent_cmd, "--workdir", str(tmp / "work"), "--json", str(out)]
    for scenario in skip:
        argv += ["--skip", scenario]
    code = main_conformance(argv)
    return code, json.loads(out.read_text())


def _verdicts(report: dict) -> dict[str, dict]:
    return {c["id"]: c for c in report["checks"]}


@pytest.fixture(scope="module")
def project_report(tmp_path_factory):
    require_mosquitto()
    return _run(tmp_path_factory.mktemp("conformance"), AGENT_CMD)


@pytest.mark.parametrize("check_id", [_param(c) for c in CHECKS])
def test_project_agent_passes_check(project_report, check_id):
    _, report = project_report
    result = _verdicts(report)[check_id]
    assert result["verdict"] == "pass", f"{check_id}: {result['verdict']} — {result['evidence']}"


def test_project_agent_is_conformant(project_report):
    code, report = project_report
    assert report["conformant"] and code == 0, [c["id"] for c in report["checks"] if c["verdict"] == "fail"]


def test_exit_code_says_whether_every_must_passed(project_report):
    code, report = project_report
    assert code == (0 if report["conformant"] else 1)
    assert report["conformant"] == (not any(c["verdict"] == "fail" and c["level"] == "MUST"
                                            for c in report["checks"]))
    assert set(_verdicts(report)) == set(CHECKS)  # every check has a verdict, skipped ones with a reason
