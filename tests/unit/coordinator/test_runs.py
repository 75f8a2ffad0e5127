"""``edgepfl runs``: runs listed from their directories, and one followed until it ends
(coordinator/ops/runs.py). The directories are written by the coordinator's own writers."""

from __future__ import annotations

import subprocess
import sys
import threading

from edgepfl.atomic import write_json
from edgepfl.coordinator.ops.runs import follow_run, list_runs
from edgepfl.coordinator.run_dir import RunDirectory
from edgepfl.metrics import RoundMetrics, read_run_times, record_run_end


def row(r: int, accuracy: float, final: bool = False) -> RoundMetrics:
    return RoundMetrics(round=r, final=final, accuracy=accuracy, per_client={"a": accuracy}, participants=[] if final
                        else ["a"], sampled=[] if final else ["a"], evaluated=1, dropped=[], rejected={}, aborted=False,
                        train_loss=None, bytes_up=10, bytes_down=20, shared_bytes=8, seconds=1.5)


def test_each_run_is_listed_with_its_rounds_accuracy_and_state(tmp_path):
    done, running, crashed = (RunDirectory(tmp_path / name) for name in ("done", "running", "crashed"))
    for run in (done, running, crashed):
        run.open(None)
        run.append_row(row(0, 0.5))
        run.append_row(row(1, 0.6))
    done.append_row(row(2, 0.7, final=True))
    record_run_end(done.root)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # a coordinator that died without a word
    gone.wait()
    times = read_run_times(crashed.root)
    times.sessions[-1].pid = gone.pid
    write_json(crashed.root / "run_times.json", times.model_dump(mode="json"))
    lines = {line.split()[0]: line for line in list_runs(tmp_path).splitlines()[1:-1]}
    assert "70.00%*" in lines["done"] and " done " in lines["done"] and " 2 " in lines["done"]
    assert "60.00% " in lines["running"] and " running " in lines["running"]  # this process wrote it and lives
    assert " crashed " in lines["crashed"]
    assert list_runs(tmp_path / "nothing") == f"no runs in {tmp_path / 'nothing'}"


def test_following_a_run_prints_each_row_as_it_is_written_until_the_run_ends(tmp_path):
    run = RunDirectory(tmp_path / "live")
    run.open(None)
    run.append_row(row(0, 0.5))
    printed: list[str] = []
    seen_first = threading.Event()

    def out(line: str) -> None:
        printed.append(line)
        seen_first.set()

    follower = threading.Thread(target=lambda: printed.append(f"exit {follow_run(run.root, out, every_s=0.05)}"))
    follower.start()
    assert seen_first.wait(30)
    run.append_row(row(1, 0.6))
    run.append_row(row(2, 0.65, final=True))
    record_run_end(run.root)
    follower.join(30)
    assert [line.split()[0] for line in printed[:3]] == ["round", "round", "final"]
    assert "65.00%" in printed[2] and printed[-2:] == ["the run is done", "exit 0"]
    assert follow_run(tmp_path / "nothing", printed.append) == 3
