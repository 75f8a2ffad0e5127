"""Paired readings of a benchmark run's saved state (benchmarks/final_state_eval.py):
a real tiny federation's checkpoint and agents' personal state, read both ways."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))  # as when the scripts run: they import each other from there


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


run_methods = _script("run_methods")
final_state_eval = _script("final_state_eval")

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
TINY = {"title": "tiny", "clients": 4, "paper_source": "none",
        "data": {"dataset": "fmnist", "samples_per_client": 100, "test_fraction": 0.25,
                 "partition": {"kind": "dominant", "uniform_fraction": 0.2}}}


@pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST (apt dataset-fashion-mnist) not installed")
@pytest.mark.parametrize("method", ["fedbn", "fedpick", "fedrir"])
def test_personal_batchnorm_statistics_are_read_stored_and_re_estimated(method, tmp_path, monkeypatch):
    """FedBN and FedPick keep every BatchNorm statistic personal, like DualFed and FedRIR:
    their final state is read with the stored statistics and with statistics re-estimated
    under the aggregated convolutions (before, the script refused them)."""
    monkeypatch.setitem(run_methods.SETTINGS, "tiny", TINY)
    monkeypatch.setattr(run_methods, "RESULTS", tmp_path / "results")
    run_methods.run_one("tiny", method, 2, 1, 0, "cpu", "t", tmp_path / "runs")
    record = final_state_eval.evaluate_run(run_methods.run_dir(tmp_path / "runs", "t", "tiny", method, 0))
    assert set(record["accuracy"]) == {"stored statistics", "recalibrated statistics"}
    assert record["clients"] == [f"agent-{i:02d}" for i in range(4)] and record["test_samples"] == 4 * 25
    assert all(0.0 <= a <= 1.0 for a in record["accuracy"].values())


@pytest.mark.parametrize("method_name", ["fedbn", "fedpick"])
def test_without_a_rule_of_its_own_every_batchnorm_layer_is_re_estimated_through_the_whole_model(method_name):
    import copy

    import torch

    from edgepfl.config import ModelSpec, TrainConfig

    from method_kit import MethodKit, bn_inputs

    kit = MethodKit(num_classes=4, input_shape=(1, 28, 28), spec=ModelSpec(), train=TrainConfig(epochs=1))
    data = kit.quadrant_data()
    method, model = kit.build(method_name)
    method.local_update(model, data, kit.ctx())
    _, other = kit.build(method_name, seed=5)  # the aggregate arrives: the stored statistics describe another model
    method.receive(model, method.init_server(other).global_tensors, kit.ctx())
    ref = copy.deepcopy(model)
    expected = bn_inputs(ref, ref, data.x_train)
    assert not hasattr(method, "recalibrate") and expected

    readings = final_state_eval._stored_then_recalibrated(method, model, data)
    assert next(readings) == "stored" and not model.training
    stored = {k: v.clone() for k, v in model.state_dict().items() if "running_mean" in k}
    assert next(readings) == "recalibrated" and not model.training
    layers = dict(model.named_modules())
    for name, inputs in expected.items():
        x = inputs.transpose(0, 1).flatten(1) if inputs.dim() == 4 else inputs.transpose(0, 1)  # channels x samples
        torch.testing.assert_close(layers[name].running_mean, x.mean(1))
        torch.testing.assert_close(layers[name].running_var, x.var(1, unbiased=True))
        assert not torch.equal(layers[name].running_mean, stored[f"{name}.running_mean"])
