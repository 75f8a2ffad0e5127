"""Runs that older trainers cannot run as written go only to trainers that announced the
protocol version: series or vector inputs (1.10; an older agent would refuse the run spec's
2- or 1-entry input_shape as malformed, never train) and clipped local gradients (1.11)."""

from __future__ import annotations

from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import LocalFleet
from edgepfl.coordinator.registry import Registry
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.protocol import INPUT_KINDS, SECURE_AGGREGATION, Capabilities, StatusMeta


def _online(registry: Registry, **versions: str) -> None:
    for agent_id, version in versions.items():
        registry.update(agent_id, StatusMeta(state="online", num_train=10, version=version, capabilities=Capabilities()))


def test_a_series_run_leaves_out_trainers_before_1_10(tmp_path):
    config = RunConfig(model={"arch": "identity"})
    norm = {"mean": [0.0] * 6, "std": [1.0] * 6}
    series = Coordinator(config, LocalFleet({}, config.federation), tmp_path / "s", progress=False,
                         input_shape=(6, 100), num_classes=4, normalization=norm)
    assert series.run_spec.data.input_kind == "series"
    _online(series.registry, old="1.9", new="1.10")
    assert series.registry.eligible() == ["new"]
    images = Coordinator(config, LocalFleet({}, config.federation), tmp_path / "i", progress=False,
                         input_shape=(1, 8, 8), num_classes=4, normalization={"mean": [0.5], "std": [0.5]})
    _online(images.registry, old="1.9", new="1.10")
    assert sorted(images.registry.eligible()) == ["new", "old"]


def test_the_latest_required_feature_holds():
    registry = Registry()
    _online(registry, a="1.8", b="1.9", c="1.10")
    registry.require_protocol(INPUT_KINDS, "series inputs")
    registry.require_protocol(SECURE_AGGREGATION, "secure aggregation")  # a secure series run still needs 1.10
    _online(registry, a="1.8", b="1.9", c="1.10")
    assert registry.eligible() == ["c"]


def test_a_run_that_clips_local_gradients_leaves_out_trainers_before_1_11_and_its_run_spec_says_so(tmp_path):
    """An older trainer ignores ``train.max_grad_norm`` (an unknown field) and would train
    unclipped; a run without it keeps every trainer, and its run spec leaves the field out."""
    shape = {"input_shape": (1, 8, 8), "num_classes": 4, "normalization": {"mean": [0.5], "std": [0.5]}}
    clipping = Coordinator(RunConfig(model={"arch": "identity"}, train={"max_grad_norm": 2.0}),
                           LocalFleet({}, "f"), tmp_path / "c", progress=False, **shape)
    _online(clipping.registry, old="1.10", new="1.11")
    assert clipping.registry.eligible() == ["new"]
    assert clipping.run_spec.model_dump(mode="json")["train"]["max_grad_norm"] == 2.0
    plain = Coordinator(RunConfig(model={"arch": "identity"}), LocalFleet({}, "f"), tmp_path / "p", progress=False,
                        **shape)
    _online(plain.registry, old="1.10", new="1.11")
    assert sorted(plain.registry.eligible()) == ["new", "old"]
    assert "max_grad_norm" not in plain.run_spec.model_dump(mode="json")["train"]
