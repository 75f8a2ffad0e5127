"""A coordinator killed at any point of writing its state resumes to the same final state
(a red team's finding, docs/SECURITY.md).

Each case runs a small in-process federation (virtual clock: the same seed gives the same
bits) with ``EDGEPFL_FAILPOINT`` set, so the process sends itself SIGKILL at one named
point of one save (:mod:`edgepfl.failpoints`): inside an atomic write, between a
checkpoint's two files, between a round's row, good state and checkpoint. The run is then
resumed, and must end with the same checkpoint bits as a run never interrupted, with
every round's row exactly once.

The run never interrupted is a fresh interpreter; the killed and resumed runs are processes
forked from one that has imported torch and edgepfl already (tests/warm_cli.py), so twenty
runs do not pay twenty start-ups, and the final bits are still compared across interpreters
(another string hash seed, other global random states).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from edgepfl.failpoints import ENV, POINTS

from tests.fleet_helpers import checkpoint_tensors, read_rows, run_config
from tests.warm_cli import WarmCli

ROUNDS = 3
#: (point, which hit of it): per training round the coordinator appends a row, keeps a good
#: state and writes the checkpoint, each of the last two a tensor file and a state.json; so
#: the 3rd and 4th checkpoint writes are round 1's good state and round 1's checkpoint
CASES = [
    ("round.row_appended", 1),  # before the first checkpoint: nothing to resume, the row must not stay twice
    ("round.row_appended", 2),
    ("round.good_state_kept", 2),
    ("checkpoint.tensors_written", 3),
    ("checkpoint.committed", 3),
    ("checkpoint.tensors_written", 4),  # the new tensor file beside the old state.json (refused to resume before)
    ("checkpoint.committed", 4),
    ("round.checkpointed", 2),
    ("atomic.written", 6),
    ("atomic.renamed", 6),
]


def test_the_cases_cover_every_failpoint():
    # the agent's points kill an agent mid-round, not the coordinator mid-write
    # (tests/integration/security/test_secure_aggregation.py kills at agent.train_task), the site's
    # a site aggregator (tests/integration/rounds/test_sites_live.py kills at site.tasks_sent)
    assert {point for point, _ in CASES} == {p for p in POINTS if not p.startswith(("agent.", "site."))}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    config = run_config(model={"arch": "mlp", "feature_dim": 16}, data={"samples_per_client": 100}, rounds=ROUNDS)
    path = tmp_path_factory.mktemp("crash") / "run.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def simulate(config_path: Path, out: Path, *extra: str, failpoint: str | None = None,
             warm: WarmCli | None = None) -> subprocess.CompletedProcess:
    """``edgepfl simulate`` in process with two agents: a fresh interpreter, or a child of ``warm``."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if failpoint is not None:
        env[ENV] = failpoint
    argv = ["simulate", "--in-process", "--config", str(config_path), "--agents", "2", "--out", str(out), *extra]
    if warm is not None:
        return warm.run("edgepfl.cli", argv, env=env, timeout=600)
    return subprocess.run([sys.executable, "-m", "edgepfl.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmCli]:
    # what every run imports; the first optimizer of a process imports torch._dynamo
    with WarmCli(["torch", "torch._dynamo", "edgepfl.cli", "edgepfl.coordinator.simulate"]) as server:
        yield server


@pytest.fixture(scope="module")
def uninterrupted(config_path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = simulate(config_path, out)
    assert done.returncode == 0, done.stderr[-3000:]
    return checkpoint_tensors(out / "checkpoint")


@pytest.mark.parametrize(("point", "hit"), CASES, ids=[f"{p}:{n}" for p, n in CASES])
def test_a_coordinator_killed_at_a_write_point_resumes_to_the_uninterrupted_final_state(
        config_path, uninterrupted, warm, tmp_path, point, hit):
    out = tmp_path / "run"
    killed = simulate(config_path, out, failpoint=f"{point}:{hit}", warm=warm)
    assert killed.returncode == -signal.SIGKILL, f"never reached {point}:{hit}\n{killed.stderr[-3000:]}"
    resumed = simulate(config_path, out, "--resume", warm=warm)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = checkpoint_tensors(out / "checkpoint")
    assert final.keys() == uninterrupted.keys()
    assert all(final[k].tobytes() == uninterrupted[k].tobytes() for k in final), "the resumed run ended elsewhere"
    rows = read_rows(out)
    assert [r.round for r in rows if not r.final] == list(range(ROUNDS)), "a round's row is missing or twice"
    assert sum(r.final for r in rows) == 1
    # nothing a crash left half-written stays behind once the run has checkpointed again
    files = {p.name for p in (out / "checkpoint").iterdir() if p.is_file()}
    assert files == {"state.json", next((out / "checkpoint").glob("state-*.safetensors")).name}, files


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_is_one_line_naming_the_file_and_the_cure_not_an_internal_error(config_path, tmp_path):
    """The red team filled the disk under a running coordinator: it ended with "internal
    error". Here a real run writes into a 16 KiB tmpfs, which fills during round 0. The
    process must exit with the data code (3) and end with one ``edgepfl:`` line naming the
    file it could not write, the cause and what to do; no "internal error"."""
    import shutil

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        done = simulate(config_path, disk / "run")
    finally:
        subprocess.run(["umount", str(disk)], check=True)
        shutil.rmtree(disk, ignore_errors=True)
    assert done.returncode == 3, done.stderr[-3000:]  # ExitCode.DATA (docs/OPERATING.md, exit codes)
    last = done.stderr.strip().splitlines()[-1]
    assert "internal error" not in done.stderr, done.stderr[-3000:]
    assert last.startswith(f"edgepfl: cannot write {disk / 'run'}/") and "No space left on device" in last, last
    assert "free space" in last and "resumes from its last checkpoint" in last, last
