"""The conformance kit cannot be fooled: its mutation suite.

Each mutant is edgepfl's own agent with one deliberate break (tests/integration/agent/
mutant_agent.py): the six a Node.js agent written from the documents slipped past an
earlier kit (preprocessing, class order, body hash, release signature, unsequenced
releases, expired tasks) and the other MUSTs an implementer could drop. The kit runs
against each, in the scenario that exercises the break, and must say NOT CONFORMANT with
exactly the checks that name the break failed: a break blamed on another check, or a
check failed by a break it does not name, fails the test. Each variant is the agent with a
change the text allows (a report under `done` dropped): the kit must find it conformant.

A head mutant runs under ``--profile head``, as a head-only device is certified: the
profile fails it for a broken head check. The kit runs are processes (``edgepfl
conformance``), three at a time, forked from one interpreter that has imported torch and the
kit already (tests/warm_cli.py); each starts its own Mosquitto and agent processes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import require_mosquitto
from tests.integration.agent.mutant_agent import MUTANTS, VARIANTS
from tests.warm_cli import WarmCli

MUTANT_AGENT = Path(__file__).with_name("mutant_agent.py")

#: mutant -> (the scenario that exercises the break, the MUST checks that must fail: no others)
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "pixels_over_255_only": ("session", {"task.preprocessing"}),
    "its_own_normalization": ("session", {"task.preprocessing"}),
    "local_label_numbers": ("session", {"task.class_order"}),
    "normalizes_only_in_evaluate": ("session", {"train.preprocessing"}),
    "maps_labels_only_in_evaluate": ("session", {"train.class_order"}),
    "no_body_hash_check": ("session", {"frames.body_hash"}),
    "ignores_announced_m": ("session", {"chunking.send", "limits.announced_m"}),
    "retrains_a_redelivered_task": ("session", {"idempotency.redelivery"}),
    "any_major_version": ("session", {"version.other_major"}),
    "no_roll_call": ("session", {"presence.roll_call"}),
    "takes_every_task_topic": ("session", {"task.own_topic"}),
    "uploads_personal_parts": ("session", {"personal.stays"}),
    "runs_expired_tasks": ("signatures", {"signing.expired_task"}),
    "runs_stale_tasks": ("signatures", {"signing.stale"}),
    "runs_tasks_for_others": ("signatures", {"signing.wrong_recipient"}),
    "runs_unsigned_tasks": ("signatures", {"signing.unsigned_task"}),
    "no_release_signature_check": ("head", {"release.signature"}),
    "head_pixels_over_255_only": ("head", {"head.preprocessing"}),
    "head_its_own_normalization": ("head", {"head.preprocessing"}),
    "no_release_hash_check": ("head", {"release.sha256"}),
    "installs_rollbacks": ("head", {"release.rollback"}),
    "installs_expired_releases": ("head", {"release.expired"}),
    "installs_unsequenced_releases": ("head", {"release.unsequenced"}),
    "unsigned_head_metrics": ("head", {"head.signing"}),
    "head_leaks_its_head_in_values": ("head", {"head.values"}),
    "ignores_retained_parts": ("head", {"release.parts"}),
    "trusts_its_stored_release": ("head", {"release.reverified"}),
    "no_body_hash_check_on_releases": ("head", {"release.body_hash"}),
    "unsigned_will": ("signatures", {"signing.will"}),
}
SCENARIOS = ("session", "reconnect", "signatures", "head")
#: variant -> (its scenario, check -> what its evidence must say): changes the protocol allows
CONFORMANT: dict[str, tuple[str, dict[str, str]]] = {
    # §10: a report under `done` may be dropped (the 1.2 agent of issue #54 failed release.parts 5 of 6 runs)
    "silent_under_done": ("head", {"release.parts": "no report under `done`", "release.install": "retained whole"}),
}


def test_every_mutant_has_an_expectation_and_the_suite_is_big_enough():
    assert set(EXPECTED) == set(MUTANTS) and set(CONFORMANT) == set(VARIANTS)
    assert len(MUTANTS) >= 15


def _run_kit(kit: WarmCli, name: str, root: Path) -> tuple[int, dict, str]:
    scenario, _ = {**EXPECTED, **CONFORMANT}[name]
    work = root / name
    work.mkdir(parents=True)
    command = f"{{python}} {MUTANT_AGENT} {name} {{config}}"
    argv = ["conformance", "--workdir", str(work / "kit"),
            "--json", str(work / "report.json"), "--agent-cmd", command, "--head-agent-cmd", command]
    # a head mutant is certified as a head agent (--profile head), a trainer one in its scenario alone
    argv += ["--profile", "head"] if scenario == "head" else [
        arg for other in SCENARIOS if other != scenario for arg in ("--skip", other)]
    proc = kit.run("edgepfl", argv, timeout=900, cwd=Path(__file__).parents[3])
    report = json.loads((work / "report.json").read_text()) if (work / "report.json").exists() else {}
    return proc.returncode, report, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.fixture(scope="module")
def kit() -> Iterator[WarmCli]:
    # what every kit run imports; its probe training's first optimizer imports torch._dynamo
    with WarmCli(["torch", "torch._dynamo", "edgepfl.cli", "edgepfl.conformance.kit",
                  "edgepfl.conformance.probes"]) as server:
        yield server


@pytest.fixture(scope="module")
def mutant_reports(kit, tmp_path_factory) -> dict[str, tuple[int, dict, str]]:
    require_mosquitto()
    root = tmp_path_factory.mktemp("mutants")
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = {name: pool.submit(_run_kit, kit, name, root) for name in [*EXPECTED, *CONFORMANT]}
        return {name: run.result() for name, run in runs.items()}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_kit_finds_the_mutant_not_conformant_under_the_check_that_names_its_break(mutant_reports, name):
    code, report, output = mutant_reports[name]
    assert report, f"{name}: the kit wrote no report (exit {code}): {output}"
    scenario, expected = EXPECTED[name]
    verdicts = {c["id"]: c for c in report["checks"]}
    failed = {c["id"] for c in report["checks"] if c["verdict"] == "fail" and c["level"] == "MUST"}
    evidence = {k: verdicts[k]["evidence"] for k in failed | expected if k in verdicts}
    assert failed == expected, f"{name}: MUST checks failed {sorted(failed)}, expected {sorted(expected)}: {evidence}"
    assert not report["conformant"] and code == 1
    # the rest of its scenario ran: the break did not stop the kit before the checks after it
    ran = [c for c in report["checks"] if c["evidence"] and scenario in SCENARIOS and c["verdict"] == "pass"]
    assert len(ran) >= 4, f"{name}: only {len(ran)} checks passed in scenario {scenario}"


@pytest.mark.parametrize("name", sorted(CONFORMANT))
def test_the_kit_finds_an_agent_that_does_what_the_text_allows_conformant(mutant_reports, name):
    code, report, output = mutant_reports[name]
    assert report, f"{name}: the kit wrote no report (exit {code}): {output}"
    verdicts = {c["id"]: c for c in report["checks"]}
    failed = {c["id"]: c["evidence"] for c in report["checks"] if c["verdict"] == "fail" and c["level"] == "MUST"}
    assert not failed and report["conformant"] and code == 0, f"{name}: {failed}"
    _, passing = CONFORMANT[name]
    for check, says in passing.items():  # passed, and on the evidence the variant leaves
        assert verdicts[check]["verdict"] == "pass" and says in verdicts[check]["evidence"], verdicts[check]
