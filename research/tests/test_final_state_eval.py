"""Paired readings of a benchmark run's saved state (research/final_state_eval.py):
a real tiny federation's checkpoint and agents' personal state, read both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_loader import load_script as _script

run_methods = _script("run_methods")
final_state_eval = _script("final_state_eval")

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
TINY = {"title": "tiny", "clients": 4, "paper_source": "none",
        "data": {"dataset": "fmnist", "samples_per_client": 100, "test_fraction": 0.25,
                 "partition": {"kind": "dominant", "uniform_fraction": 0.2}}}


@pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST (apt dataset-fashion-mnist) not installed")
@pytest.mark.parametrize("method", ["dualfed", "fedbn", "fedpick", "fedrir"])
def test_personal_batchnorm_statistics_are_read_stored_and_re_estimated(method, tmp_path, monkeypatch):
    """FedBN and FedPick keep every BatchNorm statistic personal, like DualFed and FedRIR:
    their final state is read with the stored statistics and with statistics re-estimated
    under the aggregated convolutions (before, the script refused them)."""
    monkeypatch.setitem(run_methods.SETTINGS, "tiny", TINY)
    monkeypatch.setattr(run_methods, "RESULTS", tmp_path / "results")
    run_methods.run_one("tiny", method, 2, 1, 0, "cpu", "t", tmp_path / "runs")
    record = final_state_eval.evaluate_run(run_methods.run_dir(tmp_path / "runs", "t", "tiny", method, 0))
    readings = {"stored statistics", "recalibrated statistics"}
    if method == "dualfed":  # its ensemble, each classifier alone, the other ensemble; the floor
        readings = {f"{r}, {part}" for r in readings for part in ("ensemble", "h_p only", "h_s only", "softmax average")}
        readings.add("majority class of the train split")
    elif method == "fedpick":  # each classifier of its ensemble alone, and the other ensemble
        readings |= {f"{r}, {c} only" for r in readings for c in ("C_g", "C_p")}
        readings |= {f"{r}, softmax average" for r in ("stored statistics", "recalibrated statistics")}
    assert set(record["accuracy"]) == readings
    assert record["clients"] == [f"agent-{i:02d}" for i in range(4)] and record["test_samples"] == 4 * 25
    assert all(0.0 <= a <= 1.0 for a in record["accuracy"].values())
    # every reading per client too (equal test splits: the overall figure is their mean)
    assert set(record["per_client"]) == readings
    for label, by_client in record["per_client"].items():
        assert list(by_client) == record["clients"]
        assert sum(by_client.values()) / 4 == pytest.approx(record["accuracy"][label])



@pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST (apt dataset-fashion-mnist) not installed")
def test_fedavg_is_read_as_received_fine_tuned_and_after_local_epochs(tmp_path, monkeypatch):
    """FedPAC's two readings of its FedAvg-FT row, on FedAvg's own final state: the global
    model as received is the run's own final accuracy, client by client, and the two
    fine-tuned readings (each on a copy, from a per-client seed) repeat exactly."""
    monkeypatch.setitem(run_methods.SETTINGS, "tiny", TINY)
    monkeypatch.setattr(run_methods, "RESULTS", tmp_path / "results")
    result = run_methods.run_one("tiny", "fedavg", 2, 1, 0, "cpu", "t", tmp_path / "runs")
    run = run_methods.run_dir(tmp_path / "runs", "t", "tiny", "fedavg", 0)
    record = final_state_eval.evaluate_run(run)
    received, tuned, trained = ("global model (FedAvg)", "classifier fine-tuned 5 epochs (FedAvg-FT)",
                                "after 1 local epochs (acc2)")
    assert set(record["accuracy"]) == {received, tuned, trained}
    assert record["accuracy"][received] == pytest.approx(result["final_accuracy"])
    assert record["per_client"][received] == pytest.approx(result["final_per_client"])
    # each fine-tuning draws its batch order from a seed of the run and the client: it repeats
    assert final_state_eval.evaluate_run(run)["per_client"] == record["per_client"]
