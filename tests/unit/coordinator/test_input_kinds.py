"""A run of series or vector inputs goes only to trainers of protocol 1.10 or later: an older
agent would refuse the run spec's 2- or 1-entry input_shape as malformed, never train."""

from __future__ import annotations

from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import LocalFleet
from edgepfl.coordinator.registry import Registry
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.protocol import INPUT_KINDS, SECURE_AGGREGATION, StatusMeta


def _online(registry: Registry, **versions: str) -> None:
    for agent_id, version in versions.items():
        registry.update(agent_id, StatusMeta(state="online", num_train=10, version=version))


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
