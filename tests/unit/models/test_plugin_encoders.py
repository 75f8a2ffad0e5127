"""A user's own encoder (``model.arch: module:callable``): built from a plain module outside the
package (tests/plugins/sensor_cnn.py), checked when a run starts, trained by the methods that
split it, run by the coordinator and its agents, refused by an agent that cannot import it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgepfl.data.client import ClientTensors
from edgepfl.errors import ExitCode, ModelSpecError, classify
from edgepfl.methods import ClientUpdate, create_method
from edgepfl.models import CHECK_BATCH, PluginEncoder, build_encoder, check_encoder, is_plugin_arch
from edgepfl.specs import ModelSpec
from edgepfl.testing.method_kit import MethodKit, changed, snapshot

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
SERIES = (6, 100)  # accelerometer + gyroscope windows: 6 channels x 100 samples
KIT = MethodKit(input_shape=SERIES, spec=ModelSpec(arch="sensor_cnn:build", feature_dim=16))


@pytest.fixture(autouse=True)
def plugin_folder(monkeypatch):
    """The user's folder on the Python path, as PYTHONPATH puts it there."""
    monkeypatch.syspath_prepend(str(PLUGINS))


def series_client(seed: int, n: int, classes: list[int], gain: float = 1.0) -> ClientTensors:
    """Raw-range windows: class k is a sine of frequency k + 1 on channel k, over N(0, 1) noise, times ``gain``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(SERIES[1]) / SERIES[1]

    def split(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tensor(classes)[torch.arange(count) % len(classes)]
        x = torch.randn(count, *SERIES, generator=g)
        for i, label in enumerate(y.tolist()):
            x[i, label] += 3 * torch.sin(2 * torch.pi * (label + 1) * t)
        return gain * x, y

    x_train, y_train = split(n)
    x_test, y_test = split(12)
    return ClientTensors(x_train, y_train, x_test, y_test, KIT.num_classes)


# --------------------------------------------------------------------------- building and checking


def test_a_plugin_is_built_from_its_import_path_mounted_under_encoder_net_and_sized_as_asked():
    torch.manual_seed(0)
    encoder = build_encoder(KIT.spec, SERIES)
    assert isinstance(encoder, PluginEncoder) and encoder.out_features == 16 and is_plugin_arch(KIT.spec.arch)
    assert type(encoder.net).__name__ == "SensorCNN"
    assert encoder(torch.randn(5, *SERIES)).shape == (5, 16)
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in encoder.modules())
    lean = build_encoder(KIT.spec.model_copy(update={"norm": "none"}), SERIES)
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in lean.modules())


def test_building_a_plugin_draws_from_the_seeded_generator_as_a_built_in_does():
    """The check on the encoder moves no random state: the same seed builds the same weights."""
    torch.manual_seed(4)
    first = build_encoder(KIT.spec, SERIES)
    after = torch.rand(1)
    torch.manual_seed(4)
    second = build_encoder(KIT.spec, SERIES)
    assert torch.equal(after, torch.rand(1))
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


def test_the_check_moves_no_statistic_and_keeps_each_modules_mode():
    torch.manual_seed(0)
    encoder = build_encoder(KIT.spec, SERIES)
    encoder.train()
    encoder.net.body[1].eval()  # a mixed model, as after freezing one layer
    modes = {name: m.training for name, m in encoder.named_modules()}
    before = snapshot(encoder)
    check_encoder(encoder, KIT.spec, SERIES)
    assert changed(before, snapshot(encoder)) == set()
    assert {name: m.training for name, m in encoder.named_modules()} == modes


@pytest.mark.parametrize("arch,shape", [("cnn1d", SERIES), ("mlp", (24,)), ("mlp", SERIES), ("cnn", (1, 28, 28))])
def test_the_trainable_built_in_encoders_pass_the_check_a_plugin_must(arch, shape):
    for norm in ("batch", "none"):
        spec = ModelSpec(arch=arch, feature_dim=16, norm=norm)
        check_encoder(build_encoder(spec, shape), spec, shape)


BAD_PLUGINS = {
    "wrong output shape": ("sensor_cnn:wrong_width", "batch", f"to shape ({CHECK_BATCH}, 7), not ({CHECK_BATCH}, 16)"),
    "NaN output": ("sensor_cnn:nan_output", "batch", "non-finite features"),
    "int output": ("sensor_cnn:int_output", "batch", "returns torch.int64 features, not torch.float32"),
    "BatchNorm with norm none": ("sensor_cnn:always_batchnorm", "none", "has BatchNorm layers (net.body.1, net.body.4)"),
    "not a module": ("sensor_cnn:not_a_module", "batch", "returned a function, not a torch.nn.Module"),
    "fails to build": ("sensor_cnn:fails_to_build", "batch",
                       "building the encoder for inputs (6, 100) failed: ValueError: not enough values to unpack"),
    "unregistered layers": ("sensor_cnn:unregistered_layers", "batch", "no trainable parameters"),
    "not callable": ("sensor_cnn:not_callable", "batch", "int object is not callable"),
    "callable missing": ("sensor_cnn:missing", "batch", "sensor_cnn has no missing"),
    "import error": ("no_such_sensor_module:build", "batch",
                     "cannot import no_such_sensor_module (No module named 'no_such_sensor_module')"),
    "unknown entry point": ("no_such_encoder", "batch", "neither a built-in encoder (cnn, cnn1d,"),
}


@pytest.mark.parametrize("arch,norm,says", list(BAD_PLUGINS.values()), ids=list(BAD_PLUGINS))
def test_each_failed_check_is_one_configuration_line_naming_the_callable(arch, norm, says):
    spec = ModelSpec(arch=arch, feature_dim=16, norm=norm)
    with pytest.raises(ModelSpecError) as caught:
        build_encoder(spec, SERIES)
    line = str(caught.value)
    assert "\n" not in line and says in line, line
    assert line.startswith(f"model.arch {arch}") or line.startswith(f"model.arch {arch!r}"), line
    assert classify(caught.value) == (ExitCode.USAGE, line)


def test_a_method_builds_the_same_check_so_a_bad_plugin_stops_any_model_build():
    spec = ModelSpec(arch="sensor_cnn:nan_output", feature_dim=16)
    for name in ("fedavg", "repper"):
        with pytest.raises(ModelSpecError, match="non-finite"):
            create_method(name).build_model(spec, SERIES, 4)


def test_fedrir_which_builds_its_own_model_refuses_a_plugin_or_series_in_one_configuration_line():
    """FedRIR ignores model.arch (MODELS.md "fedrir"): a user's encoder is refused, not dropped."""
    fedrir = create_method("fedrir", {"embed_dim": 8, "q_hidden": 8})
    for spec, shape, says in [
        (KIT.spec, (1, 28, 28), "model.arch sensor_cnn:build: fedrir builds its own image extractors and decoder "
                                "and cannot train a plugin encoder"),
        (ModelSpec(arch="cnn1d"), SERIES, "fedrir's extractors take images C x H x W, and the inputs are 6x100"),
    ]:
        with pytest.raises(ModelSpecError) as caught:
            fedrir.build_model(spec, shape, 4)
        line = str(caught.value)
        assert "\n" not in line and line.startswith(says), line
        assert classify(caught.value) == (ExitCode.USAGE, line)
    assert fedrir.build_model(ModelSpec(), (1, 28, 28), 4)  # its own model on images, as before


@pytest.mark.parametrize("arch,shape,says", [
    ("cnn", SERIES, "model.arch cnn takes images C x H x W, and the inputs are 6x100: use cnn1d"),
    ("cnn1d", (1, 28, 28), "model.arch cnn1d takes series C x T, and the inputs are 1x28x28"),
])
def test_a_built_in_given_inputs_of_another_kind_says_which_encoder_fits(arch, shape, says):
    with pytest.raises(ModelSpecError, match=says):
        build_encoder(ModelSpec(arch=arch), shape)


def test_cnn1d_takes_any_length_and_mlp_takes_vectors():
    cnn1d = build_encoder(ModelSpec(arch="cnn1d", feature_dim=8), (6, 100)).eval()
    for length in (1, 7, 100, 333):
        assert cnn1d(torch.randn(2, 6, length)).shape == (2, 8)
    assert build_encoder(ModelSpec(arch="mlp", feature_dim=8), (24,))(torch.randn(3, 24)).shape == (3, 8)


# --------------------------------------------------------------------------- one round with the methods


@pytest.mark.parametrize("name", ["fedavg", "fedrep", "repper"])
def test_a_plugin_encoder_trains_a_round_on_raw_sensor_windows_and_its_split_is_the_methods(name):
    method = create_method(name)
    state0 = method.init_server(KIT.model(method, 0))
    clients = {"agent-a": series_client(1, 40, [0, 1, 2, 3]), "agent-b": series_client(2, 24, [1, 2], gain=4.0)}
    updates = []
    for i, (agent, data) in enumerate(clients.items()):
        model = KIT.model(method, 100 + i)
        ctx = KIT.ctx(10 + i)
        method.receive(model, method.payload_for(state0, agent), ctx)
        before = snapshot(model)
        result = method.local_update(model, data, ctx)
        assert set(result.upload) == set(method.shared_keys(model))
        assert all(np.isfinite(v).all() for v in result.upload.values())
        assert any(k.startswith("encoder.net.") for k in changed(before, snapshot(model)))
        evaluated = method.evaluate(model, data, ctx)
        assert 0 <= evaluated.correct <= len(data.y_test)
        updates.append(ClientUpdate(agent, data.num_train, result.upload))
    for update in updates:
        method.check_update(state0, update)
    state1 = method.server_step(state0, updates, 0)
    encoder_keys = {k for k in state0.global_tensors if k.startswith("encoder.net.")}
    assert encoder_keys and {k for k in encoder_keys
                             if not np.array_equal(state0.global_tensors[k], state1.global_tensors[k])}
    heads_shared = {k for k in state0.global_tensors if k.startswith("head.")}
    assert bool(heads_shared) == (name == "fedavg")  # FedRep's and RepPer's heads stay on the device


@pytest.mark.parametrize("name,encoder_shared,bn_shared,head_shared", [
    ("fedavg", True, True, True), ("fedper", True, True, False), ("fedrep", True, True, False),
    ("fedbn", True, False, True), ("lgfedavg", False, False, True),
])
def test_the_methods_share_a_plugins_tensors_as_a_built_in_encoders(name, encoder_shared, bn_shared, head_shared):
    method = create_method(name)
    model = KIT.model(method)
    shared = set(method.shared_keys(model))
    conv = "encoder.net.body.0.weight"
    batchnorm = "encoder.net.body.1.weight"
    assert (conv in shared, batchnorm in shared, "head.weight" in shared) == (encoder_shared, bn_shared, head_shared)


# --------------------------------------------------------------------------- the coordinator and its agents


def test_a_coordinator_runs_a_plugin_model_with_its_agents_and_refuses_a_bad_one_when_it_starts(tmp_path):
    from edgepfl.config import RunConfig
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare
    from edgepfl.edge_agent.tiers import local_trainers

    def config(arch: str) -> RunConfig:
        return prepare(RunConfig(federation="plugin", method={"name": "fedrep"}, rounds=1, device="cpu",
                                 model={"arch": arch, "feature_dim": 8}, data={"dataset": "digits"},
                                 train={"epochs": 1, "batch_size": 32}), 2)

    good = config("sensor_cnn:tiny_mlp")
    out = tmp_path / "good"
    coordinator = Coordinator(good, LocalFleet(local_trainers(good, agent_ids(2), out), good.federation), out,
                              progress=False, **data_shape(good))
    rows = coordinator.run()
    assert rows and coordinator.state is not None
    assert sorted(coordinator.state.global_tensors) == ["encoder.net.1.bias", "encoder.net.1.weight",
                                                        "encoder.net.3.bias", "encoder.net.3.weight"]
    assert sum(coordinator.counters.refused.values()) == 0

    bad = config("sensor_cnn:nan_output")
    coordinator = Coordinator(bad, LocalFleet({}, bad.federation), tmp_path / "bad", progress=False, **data_shape(bad))
    with pytest.raises(ModelSpecError, match="model.arch sensor_cnn:nan_output: the encoder returns non-finite"):
        coordinator.init_or_resume()


def test_an_agent_that_cannot_import_the_plugin_refuses_the_task_naming_the_module(tmp_path):
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.edge_agent.tiers import TrainerTier
    from edgepfl.protocol import AgentChannel, MessageType, RefusalMeta, TaskMeta, decode, encode

    from tests.export_fixtures import client_data
    from tests.wire_samples import sample_run_spec

    spec = sample_run_spec()
    run = spec.model_copy(update={"model": ModelSpec(arch="sensor_cnn_v2:build", feature_dim=16)})
    fleet = LocalFleet({"agent-00": TrainerTier("agent-00", client_data(0), str(tmp_path), "cpu")}, "f")
    assert fleet.poll(0.1).channel == AgentChannel.STATUS
    meta = TaskMeta(task_id="a" * 32, kind="train", run=run, seed=7, deadline_s=10)
    fleet.send("agent-00", encode(MessageType.TASK, federation="f", sender="coordinator", round=0, meta=meta), 0)
    refusal = decode(fleet.poll(10.0).frame)
    assert refusal.type == MessageType.REFUSAL
    answer = refusal.meta_as(RefusalMeta)
    assert answer.reason == "unsupported_arch"
    assert "cannot import sensor_cnn_v2 (No module named 'sensor_cnn_v2')" in answer.detail


def test_an_import_path_is_not_matched_against_announced_archs_and_an_entry_point_name_is():
    from edgepfl.coordinator.registry import Registry
    from edgepfl.protocol import Capabilities

    registry = Registry()
    announced = Capabilities(methods=["fedavg"], archs=["cnn", "cnn1d", "mlp"])
    registry.require("fedavg", "sensor_cnn:build")
    assert registry.incapable(announced) is None  # the agent finds out when it builds, and refuses
    registry.require("fedavg", "sensor-cnn")
    assert registry.incapable(announced) == "its capabilities do not include arch sensor-cnn"
    assert registry.incapable(announced.model_copy(update={"archs": ["cnn", "sensor-cnn"]})) is None


# --------------------------------------------------------------------------- naming a plugin


def test_a_config_takes_an_import_path_or_an_entry_point_name_and_refuses_anything_else_in_one_message():
    from pydantic import ValidationError

    assert ModelSpec(arch="sensor_models.cnn:build").arch == "sensor_models.cnn:build"
    assert ModelSpec(arch="sensor-cnn").arch == "sensor-cnn"
    for bad in ("a b", "1x:y", "m:f:g"):
        with pytest.raises(ValidationError) as caught:
            ModelSpec(arch=bad)
        assert caught.value.error_count() == 1 and "neither a built-in encoder" in str(caught.value)


def test_an_installed_packages_entry_point_names_a_plugin_and_a_trainer_announces_it(tmp_path, monkeypatch):
    """A package installed on the path (its dist-info, as pip writes it) registers ``sensor-cnn``."""
    from edgepfl.edge_agent.trainer import buildable_archs
    from edgepfl.models import installed_plugin_archs

    info = tmp_path / "sensor_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sensor-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[edgepfl.models]\nsensor-cnn = sensor_cnn:build\nbroken = sensor_cnn:missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"sensor-cnn", "broken"} <= set(installed_plugin_archs())
    assert {"cnn1d", "sensor-cnn"} <= set(buildable_archs())
    torch.manual_seed(0)
    encoder = build_encoder(ModelSpec(arch="sensor-cnn", feature_dim=16), SERIES)
    assert isinstance(encoder, PluginEncoder) and type(encoder.net).__name__ == "SensorCNN"
    with pytest.raises(ModelSpecError, match=r"^model.arch broken \(entry point sensor_cnn:missing\): cannot load it"):
        build_encoder(ModelSpec(arch="broken", feature_dim=16), SERIES)
