"""The ``edgepfl`` command line as a user meets it: each command as a subprocess (what needs
none: tests/unit/core/test_cli.py)."""

from __future__ import annotations

import re
import subprocess
import sys


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "edgepfl.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_on_the_embedded_broker_and_writes_table_and_plot(tmp_path):
    out = tmp_path / "demo"
    proc = run_cli("demo", "--agents", "4", "--rounds", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final accuracy (after round 1, the last)" in proc.stdout and "best accuracy" in proc.stdout
    assert (out / "accuracy.png").stat().st_size > 10_000
    assert sum(1 for _ in (out / "metrics.jsonl").open()) == 3
    assert "round   1 [####################] 2/2" in proc.stderr  # progress per round, numbered from 0
    assert " on auto " not in proc.stderr and re.search(r"rounds of \w+ on (fmnist|digits) \(", proc.stderr)


def test_methods_lists_every_registered_method():
    from edgepfl.methods import available_methods

    proc = run_cli("methods")
    assert proc.returncode == 0
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert listed == available_methods()


def test_bad_config_names_the_field_and_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: {name: fedavg}\nrounds: -3\nfraction: 2\n")
    proc = run_cli("simulate", "--config", str(bad), "--agents", "2")
    assert proc.returncode == 2
    assert "rounds" in proc.stderr and "fraction" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_config_file_is_a_clear_error(tmp_path):
    proc = run_cli("coordinator", "--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "config file not found" in proc.stderr


def test_agent_refuses_the_embedded_placeholder_broker(tmp_path):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("agent_id: pi-1\n")
    proc = run_cli("agent", "--config", str(cfg))
    assert proc.returncode == 2 and "broker URL" in proc.stderr


def test_report_rebuilds_table_and_plot_from_a_run_directory(tmp_path):
    from edgepfl.coordinator.simulate import simulate
    from edgepfl.edge_agent.tiers import local_trainers

    from tests.fleet_helpers import run_config

    out = tmp_path / "run"
    simulate(run_config(rounds=1, data={"samples_per_client": 60}), 2, out, in_process=local_trainers, progress=False)
    (out / "accuracy.png").unlink()
    proc = run_cli("report", "--run", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Results — fedavg") and "final accuracy (after round 0, the last)" in proc.stdout
    assert (out / "accuracy.png").exists()


def test_demo_runs_where_fashion_mnist_is_absent(tmp_path):
    import os

    out = tmp_path / "demo"
    env = dict(os.environ, EDGEPFL_FMNIST_ROOT=str(tmp_path / "no-fmnist"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "edgepfl", "demo", "--agents", "2", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on digits" in proc.stderr and "final accuracy (after round 0, the last)" in proc.stdout
    assert "Traceback" not in proc.stderr
